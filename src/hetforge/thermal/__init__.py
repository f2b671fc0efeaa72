"""Thermal simulation of sustained generation (fixed placement vs Φ-guided re-placement); all figures modeled.

Sits above the runtime: it compiles and runs placed programs (:mod:`hetforge.runtime`) and drives the lumped RC
model of :mod:`hetforge.cost.thermal_rc`.
"""
