"""Integrations of trustclip objectives into other RL frameworks.

`trustclip.integrations.verl_plugin` registers every objective as a verl policy loss (`trustclip_<name>`),
and `trustclip.integrations.verl_config.TrustclipPolicyLossConfig` carries their hyper-parameters; both
need verl (`pip install "trustclip[verl]"`, in its own virtual environment) and are never imported from
here, so `import trustclip.integrations` stays free of framework imports.
"""
