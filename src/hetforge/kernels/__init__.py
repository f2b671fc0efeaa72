"""Native CPU kernels (C, built on first use); see :mod:`hetforge.kernels.native`."""
