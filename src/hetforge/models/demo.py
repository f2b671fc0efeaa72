"""The demo model: trained by ``scripts/train_demo.py`` and shipped with the package (issue: runtime).

Until its weights are committed this module registers nothing.
"""
