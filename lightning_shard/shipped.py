"""What the package ships besides code: the Hydra config tree (strategies, topology presets, recipes, trainer,
experiments), read at run time by the app, the topology presets and the planner.

In the wheel the tree is package data, ``lightning_shard/conf``. In a checkout ``lightning_shard/conf`` is a link
to the repository's top-level ``conf/`` (and ``lightning_shard/recipes`` to ``recipes/``: the project's layout,
docs/architecture.md), so the one path below holds for a wheel, an editable install and ``PYTHONPATH=.`` alike."""

from pathlib import Path

CONF_DIR = Path(__file__).parent / "conf"
