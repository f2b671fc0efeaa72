"""Hardware description: device, link and SoC profiles (shipped files, the calibrated host, user files).

``load_soc(name_or_path)`` is the one way in; ``list_socs()`` names what ships.
"""

from hetforge.hardware.loader import cache_dir, host_profile_path, list_socs, load_file, load_soc, save_spec
from hetforge.hardware.profile import DeviceProfile, LinkProfile, SocProfile
from hetforge.hardware.schema import DTYPES, KINDS

__all__ = [
    "DTYPES",
    "KINDS",
    "DeviceProfile",
    "LinkProfile",
    "SocProfile",
    "cache_dir",
    "host_profile_path",
    "list_socs",
    "load_file",
    "load_soc",
    "save_spec",
]
