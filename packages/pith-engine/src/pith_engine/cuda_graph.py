"""A training step captured once as a CUDA graph, then replayed: the host launches the whole step (every
micro-batch's forward and backward, the clip, the update) with one call. Launched kernel by kernel from Python,
the forward of a micro-batch kept the H200 waiting for the host (bench/RESULTS.md).

A replay runs exactly the kernels the capture recorded, on the same memory. So the step must not wait for the
host, must take the same branches with the same shapes every time, and must read all that changes from step to
step from its tensor arguments, which each call copies into the captured ones. One process only: a collective
whose sizes come from the host (expert parallelism) cannot be captured.
"""
import torch


class CaptureError(RuntimeError):
    """The step did something a CUDA graph cannot hold (a wait for the host, a copy from pageable memory)."""


class StepGraph:
    """step(*tensors) -> tensors, run eagerly for the first `eager_calls` calls (they make what a capture cannot:
    optimizer state, compiled code, library handles), captured on the next and replayed from then on; what it
    returns then is the captured outputs, overwritten by the next call. CUDA tensors only."""

    def __init__(self, step, eager_calls: int = 2):
        self.step, self.eager_calls, self.calls = step, eager_calls, 0
        self.graph, self.inputs, self.outputs = None, None, None
        self.stream = torch.cuda.Stream()   # the eager calls warm up the stream the capture records on

    def __call__(self, *inputs: torch.Tensor):
        self.calls += 1
        if self.calls <= self.eager_calls:
            return self.eagerly(*inputs)
        if self.graph is None:
            self.capture(inputs)
        for captured, given in zip(self.inputs, inputs):
            captured.copy_(given, non_blocking=True)
        self.graph.replay()
        return self.outputs

    def capture(self, inputs):
        self.inputs = [tensor.clone() for tensor in inputs]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()   # the eager steps' cached blocks, which the graph's own memory pool cannot reuse
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph, stream=self.stream):
                self.outputs = self.step(*self.inputs)
        except RuntimeError as err:   # torch's AcceleratorError is one
            self.graph = None
            cause = err.__context__ or err   # ending the capture fails too, after the operation that broke it
            first_line = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            raise CaptureError(f"the step could not be captured as a CUDA graph ({first_line})") from err

    def eagerly(self, *inputs):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            result = self.step(*inputs)
        torch.cuda.current_stream().wait_stream(self.stream)
        return result
