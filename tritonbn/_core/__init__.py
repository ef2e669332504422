"""The data path between the public forms (:mod:`tritonbn.modules`, :mod:`tritonbn.functional`) and a backend.

A call goes module (or functional form) -> :mod:`.dispatch` -> :mod:`.passes` -> a backend
(:mod:`tritonbn.backend`), each step one file, carrying three records (:mod:`.call`): the layer's
settings, the call's operands, and what backward saves. Beside the path: :mod:`.checks` (the argument
checks), :mod:`.lowering` (export), :mod:`.custom_ops` (what ``torch.compile`` traces), :mod:`.eager` (the
eager autograd Function) and :mod:`.higher_order` (double backward and forward-mode AD).
"""
