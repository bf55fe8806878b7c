"""trustclip objectives in verl: `plugin` registers every objective as a verl policy loss (`trustclip_<name>`; verl
imports it through the package's `verl.plugins` entry point), `config` holds their hyper-parameters
(`TrustclipPolicyLossConfig`, named by Hydra's `_target_`). Both need verl, so nothing is imported here."""
