"""The eight-Gaussians ring (paper §5): score, diffusion and noise-estimation tables, their figures,
the demo and the GPU job drivers."""
