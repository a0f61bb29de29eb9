"""Framework front ends (torch, JAX, MindSpore, OneFlow); each imports its framework lazily."""
