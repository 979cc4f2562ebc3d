"""The glue's private names of Lightning and Accelerate
(nccl_ddp/adapters/torch/integrations/private_names.py): the
installed versions still have every one (an upgrade that removes one fails here, naming it), the
glue refuses to load when one is gone (planted), and each extra's upper bound is the version the
glue names as tested."""

from __future__ import annotations

import re
import sys

import pytest
from paths import ROOT

from nccl_ddp.adapters.torch.integrations import private_names
from nccl_ddp.errors import FrameworkVersionError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def _gone(library, present):
    """The failure message of an upgrade that removed names we rely on."""
    return (
        f"{library} {private_names.metadata.version(library)} no longer has "
        f"{private_names.missing(present)}: update nccl_ddp/adapters/{library}.py "
        f"(tested with {private_names.TESTED[library]})"
    )


@pytest.mark.slow
def test_lightning_has_every_private_name_the_strategy_uses():
    pytest.importorskip("lightning")
    from nccl_ddp.adapters.torch.integrations import lightning as glue

    present = glue.private_names_present()
    assert set(present) >= {"DDPStrategy._setup_model", "DDPStrategy._register_ddp_hooks"}
    assert all(present.values()), _gone("lightning", present)
    strategy = glue.DDPStrategy()
    attrs = {a: hasattr(strategy, a) for a in glue.INSTANCE_ATTRS}
    assert all(attrs.values()), _gone("lightning", attrs)
    assert isinstance(glue.NcclDDPStrategy()._forward_redirection, glue._Redirection)


def test_accelerate_still_looks_torch_ddp_up_by_name():
    pytest.importorskip("accelerate")
    from nccl_ddp.adapters.torch.integrations import accelerate as glue

    present = glue.private_names_present()
    assert present, "accelerate's source is not installed: the swap cannot be checked"
    assert all(present.values()), _gone("accelerate", present)


def test_a_removed_private_name_is_named_with_the_tested_version(monkeypatch):
    monkeypatch.setattr(private_names.metadata, "version", lambda lib: "9.0.0")
    with pytest.raises(FrameworkVersionError) as e:
        private_names.require("lightning", {"DDPStrategy._setup_model": False, "DDPStrategy.x": True})
    msg = str(e.value)
    assert "private name DDPStrategy._setup_model, which lightning 9.0.0 no longer has" in msg, msg
    assert "tested with lightning 2.6.6: pip install 'lightning<=2.6.6'" in msg, msg
    assert isinstance(e.value, ImportError)  # `import nccl_ddp.lightning` fails as an import
    private_names.require("lightning", {"DDPStrategy._setup_model": True})  # all there: no error


@pytest.mark.slow
def test_lightning_glue_refuses_a_lightning_without_setup_model(monkeypatch):
    pytest.importorskip("lightning")
    from nccl_ddp.adapters.torch.integrations import lightning as glue

    monkeypatch.delattr(glue.DDPStrategy, "_setup_model")
    with pytest.raises(FrameworkVersionError, match=r"private name DDPStrategy\._setup_model, which"):
        private_names.require("lightning", glue.private_names_present())


@pytest.mark.slow
def test_lightning_strategy_refuses_a_ddp_strategy_without_its_attributes(monkeypatch):
    pytest.importorskip("lightning")
    from nccl_ddp.adapters.torch.integrations import lightning as glue

    theirs = glue.DDPStrategy.__init__

    def without_kwargs(self, *args, **kwargs):
        theirs(self, *args, **kwargs)
        del self._ddp_kwargs

    monkeypatch.setattr(glue.DDPStrategy, "__init__", without_kwargs)
    with pytest.raises(FrameworkVersionError, match=r"private name DDPStrategy\._ddp_kwargs, which"):
        glue.NcclDDPStrategy()


def test_accelerate_glue_refuses_a_prepare_model_that_imports_ddp(monkeypatch):
    pytest.importorskip("accelerate")
    from nccl_ddp.adapters.torch.integrations import accelerate as glue

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        return DistributedDataParallel(model)  # noqa: F821  (a module-level import of torch's DDP)

    monkeypatch.setattr(glue.accelerate.Accelerator, "prepare_model", prepare_model)
    with pytest.raises(FrameworkVersionError, match="torch.nn.parallel.DistributedDataParallel inside"):
        private_names.require("accelerate", glue.private_names_present())


def test_each_glue_extra_is_bounded_by_the_tested_version():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for library, tested in private_names.TESTED.items():
        for extra in (library, "test-frameworks"):
            (req,) = [r for r in extras[extra] if re.match(rf"{library}\b", r)]
            assert f"<={tested}" in req, f'pyproject.toml [{extra}]: "{req}" should end "<={tested}"'


@pytest.mark.slow
def test_transformers_has_every_private_name_the_trainer_uses():
    pytest.importorskip("transformers")
    from nccl_ddp.adapters.torch.integrations import transformers as glue

    present = glue.private_names_present()
    assert len(present) == 4  # + Trainer._save_optimizer_and_scheduler (ZeRO checkpoints)
    assert all(present.values()), _gone("transformers", present)
