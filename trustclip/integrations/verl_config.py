"""The dotted path Hydra `_target_`s written for earlier trustclip versions name
(`trustclip.integrations.verl_config.TrustclipPolicyLossConfig`): the very module `trustclip.integrations.verl.config`,
under this name too."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("trustclip.integrations.verl.config")
