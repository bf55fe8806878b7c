"""The dotted path verl configurations written for earlier trustclip versions name (`VERL_USE_EXTERNAL_MODULES`,
the `verl.plugins` entry point of an older install, `python -m`): the very module `trustclip.integrations.verl.plugin`,
under this name too."""

import importlib
import runpy
import sys

if __name__ == "__main__":  # `python -m trustclip.integrations.verl_plugin`: the plugin's own check
    runpy.run_module("trustclip.integrations.verl.plugin", run_name="__main__", alter_sys=True)
else:
    sys.modules[__name__] = importlib.import_module("trustclip.integrations.verl.plugin")
