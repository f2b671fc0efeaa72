"""The ``hetforge`` command line: a thin layer over the library's stage functions."""
