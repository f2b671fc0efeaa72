"""Heterogeneous execution: cut a placed graph (or a scheduled Program) into per-device partitions, compile
each on its device's backend, and run them in order with timed, counted transfers between them."""
