"""The shims for transformers API renamed inside the supported range (trustclip/integrations/trl/compat.py) work on the
installed release: `make test` runs this at the lock's versions and `make test-min` at the declared lower bounds."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")


@pytest.mark.parametrize("config_class", ["GRPOConfig", "SFTConfig"])
def test_checkpointing_off_turns_checkpointing_off_without_a_deprecation_warning(config_class, tmp_path, recwarn):
    """TRL's configs default checkpointing to True; the shim's keywords are accepted by the installed transformers
    (5.17 knows only `gradient_checkpointing`, 5.2x renamed it) and leave it off under every name the release has."""
    import trl

    from trustclip.integrations.trl.compat import checkpointing_off

    args = getattr(trl, config_class)(output_dir=str(tmp_path), use_cpu=True, report_to="none", **checkpointing_off())
    assert args.gradient_checkpointing is False
    assert getattr(args, "activation_checkpointing", False) is False
    assert not [w for w in recwarn if "checkpointing" in str(w.message)]
