"""The Hydra application around the strategies, minus Hydra itself (``lightning_shard.train`` imports Hydra).

``schema``  structured-config dataclasses (registered in Hydra's ConfigStore by ``train.py``) and knob checks
``checks``  pre-launch validation: knob choices, constructor keywords, recipe paths, batch arithmetic
``launch``  devices, nodes and accelerator derived from a topology preset
``report``  per-run ``summary.json`` and the sweep comparison (Markdown table + PNG)
"""
