"""Integrations of trustclip objectives into other RL frameworks: `verl_plugin` (every objective as a verl policy loss)
and `verl_config` (their hyper-parameters). Both need verl, so nothing is imported here."""
