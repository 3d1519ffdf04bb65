"""The shared options (cli/options.py): groups flattened into each command, and core errors,
which name fields, worded with the CLI's options. (No `from __future__ import annotations`
here: `flatten` resolves the annotations of the command below in this module's globals.)"""

import dataclasses
import inspect

import pytest

from specli.cli.options import OPTION_NAMES, Placement, Sampling, error_message, flatten
from specli.decoding.sampling import SamplingParams
from specli.errors import SettingError


def test_flatten_lays_out_the_groups_and_hands_one_object_each():
    seen = {}

    @flatten
    def command(*, placement: Placement, quiet: bool = False, sampling: Sampling = Sampling(temperature=0.0)) -> int:
        seen.update(placement=placement, quiet=quiet, sampling=sampling)
        return 7

    params = inspect.signature(command).parameters
    fields = [f.name for f in dataclasses.fields(Placement)] + ["quiet"] + [f.name for f in dataclasses.fields(Sampling)]
    assert list(params) == fields  # each group's fields in the group's place
    assert params["temperature"].default == 0.0 and params["top_k"].default == SamplingParams().top_k
    assert params["n_ctx"].default == Placement().n_ctx
    assert command(**{name: p.default for name, p in params.items()} | {"n_ctx": 512}) == 7
    assert seen == {"placement": Placement(n_ctx=512), "quiet": False, "sampling": Sampling(temperature=0.0)}


def test_a_refused_setting_names_the_field_and_the_cli_says_the_option():
    with pytest.raises(SettingError) as info:
        SamplingParams(top_k=-1).validate()
    assert str(info.value).startswith("top_k must be an integer >= 0")  # as a batch item spells it
    assert error_message(info.value).startswith("--top-k must be an integer >= 0")


def test_every_setting_the_core_names_has_an_option_of_run():
    from typer.main import get_command

    from specli.cli.app import app

    run = get_command(app).commands["run"]
    options = {name for param in run.params for name in param.opts}
    settings = {f.name for f in dataclasses.fields(SamplingParams)} | {"draft_length", "n_ctx", "max_tokens"}
    assert settings <= OPTION_NAMES.keys()
    assert set(OPTION_NAMES.values()) <= options
