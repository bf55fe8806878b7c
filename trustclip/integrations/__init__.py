"""trustclip objectives inside RL frameworks: `trl` (TRL's GRPOTrainer with the loss step replaced by any objective,
and its config) and `verl` (every objective as a verl policy loss, and its config). Each needs its framework, so
nothing is imported here."""
