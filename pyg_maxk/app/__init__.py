"""The training application built on the library: the ``pyg-maxk`` command
line (:mod:`.cli`), full-batch, mini-batch and DDP training loops
(:mod:`.training`) and the datasets they train on, synthetic or real
(:mod:`.datasets`). The layers and ops (``pyg_maxk.nn``, ``pyg_maxk.ops``)
do not depend on it.
"""
