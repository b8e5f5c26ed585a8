"""Scripts written as a user of the package writes them: they import `zckpt_nb` and DeepSpeed, nothing else."""
