"""Studies of the seed-stratified bootstrap intervals of the diffusion metrics."""
