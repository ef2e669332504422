"""The backends, peers behind one selector (:mod:`tritonbn.backend`, ``TRITONBN_BACKEND``).

Each offers the same four launchers, ``batch_norm_stats``, ``batch_norm_elemt``,
``batch_norm_backward_reduce`` and ``batch_norm_backward_elemt``, over plain tensors (see
:mod:`tritonbn.kernels` for what each takes and returns):

* :mod:`tritonbn.backends.triton`: the Triton kernels (CUDA, ROCm, and CPU under the Triton interpreter);
* :mod:`tritonbn.backends.torch`: the same math in torch's own ops, which also offers a local path
  (``local``) for layers that synchronize with nobody.

Both implement the launchers of :mod:`tritonbn.backends.launchers`, which also writes their public signatures once
(:class:`~tritonbn.backends.launchers.Launchers`), and the records a call's tensors travel in.

A backend knows nothing of autograd, modules or collectives: it imports only :mod:`tritonbn._compat`,
:mod:`tritonbn._numerics`, :mod:`tritonbn.activations` and :mod:`tritonbn.backends.launchers` from the rest of the
package. Neither backend names the other.
"""
