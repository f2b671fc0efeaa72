"""Program IR: virtual registers, device-tagged instructions, a diffable text form, save/load."""

from hetforge.ir.program import (
    INPLACE,
    INPUT,
    KERNEL,
    OUTPUT,
    TEMP,
    TRANSFER,
    VIEW,
    WEIGHT,
    Instr,
    Program,
    Reg,
    Value,
    WeightRef,
    iter_regs,
    map_regs,
)
from hetforge.ir.serialize import ProgramFileError, checksum, load_program, resolve_op, save_program

__all__ = [
    "INPLACE", "INPUT", "KERNEL", "OUTPUT", "TEMP", "TRANSFER", "VIEW", "WEIGHT",
    "Instr", "Program", "ProgramFileError", "Reg", "Value", "WeightRef",
    "checksum", "iter_regs", "load_program", "map_regs", "resolve_op", "save_program",
]
