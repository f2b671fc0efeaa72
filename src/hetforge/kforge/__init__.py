"""KForge: agentic kernel synthesis (problems, a guarded harness, platforms, agents, providers, the loop).

See docs/arch/kforge.md. Nothing in the compiler pipeline imports this package; it imports the
hardware profiles (roofline) and, for ``register``, the op registry.
"""
