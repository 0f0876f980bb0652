"""What a training process knows about its own life, below every other layer: fault injection
(:mod:`~dtlab.runtime.faults`), stop signals (:mod:`~dtlab.runtime.signals`) and the status files a
launcher reads (:mod:`~dtlab.runtime.status`). Nothing here imports torch, MLX or another dtlab layer
but :mod:`dtlab.errors`."""
