"""The Hydra application around the strategies (``python -m lightning_shard.train``, a shim over this package).

``schema``     structured-config dataclasses (registered in Hydra's ConfigStore by ``config``) and knob checks
``checks``     pre-launch validation: knob choices, constructor keywords, recipe paths, batch arithmetic
``config``     Hydra registration, the checks of a composed config, the Trainer's keywords/callbacks/loggers
``preflight``  every job of an argv composed and checked before anything starts; one-line errors
``resume``     ``ckpt_path=last|<run folder>|<file>`` and the final ``last.ckpt``
``run``        one fit (and a sweep job in a fresh process)
``summary``    the summary table, the run folder and next steps, Lightning's messages in the run's log files
``launch``     devices, nodes and accelerator derived from a topology preset
``report``     per-run ``summary.json`` and the sweep comparison (Markdown table + PNG)
"""
