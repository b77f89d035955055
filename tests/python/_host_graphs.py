"""HostGraphs: fp8dp.make_graphed_callables' capture procedure (python/fp8dp/graph.py) on the CPU,
for the tests of fp8dp's host work (test_graph_record_ddp.py, test_graph_capture_host.py).

A CPU "capture" runs its work (there is no stream to record it on) and a "replay" computes
nothing, so a test captures with the inputs and grad_output of the one call it then replays.
"""

import contextlib

from fp8dp import graph


class HostGraphs(graph._CudaGraphs):
    """The capture's CUDA calls on the CPU: a graph is captured by running its work (there is no
    stream to record it on) and replays nothing; grad_output is the given tensor."""

    class Graph:
        replays = []  # every replay, in order (the refusal test: none after a refused check)
        on_replay = None  # a test's probe of the state a replay runs in

        def replay(self):
            HostGraphs.Graph.replays.append(self)
            if HostGraphs.Graph.on_replay is not None:
                HostGraphs.Graph.on_replay()

    def __init__(self, dy):
        self.dy = dy

    pool = staticmethod(lambda: None)
    stream = staticmethod(lambda: None)
    on_stream = staticmethod(lambda s: contextlib.nullcontext())
    synchronize = staticmethod(lambda: None)
    new_graph = Graph
    capture = staticmethod(lambda g, pool, s: contextlib.nullcontext())

    def grad_output(self, o):
        return self.dy.clone()
