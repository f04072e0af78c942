"""Diffusion math as small pure functions: timestep densities, objectives, samplers."""
