"""One module per command group; each registers its commands on ``hetforge.cli.common.app``."""
