"""Studies of the trained posterior: architecture ablation and quality numbers."""
