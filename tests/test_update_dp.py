"""The update over ``ppo.processes`` processes is an execution setting: left out of the stage's version. (That a
2-process update commits the 1-process update is tested with the sharded run in ``tests/test_fanout.py``.)"""

from __future__ import annotations

from focus_core.config import execution_only_fields, load_config
from tasks.stage import RunContext


def test_processes_are_left_out_of_stage_versions():
    one, two = (RunContext(None, "r", load_config(None, [f"ppo.processes={n}"])) for n in (1, 4))
    assert one.fields("ppo") == two.fields("ppo") and "processes" not in one.fields("ppo")["ppo"]
    assert execution_only_fields() == {"ppo.processes"}
