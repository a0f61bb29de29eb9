"""Framework front ends: torch (DTensor, DCP), JAX (Orbax), MindSpore, OneFlow.

Each module imports its framework lazily, inside the functions that need it,
so ``import reshard.store`` never pulls torch or jax in.
"""
