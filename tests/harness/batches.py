"""A replica's share of a step's global batch, for the MPI worker bodies that compare a
layout with one process: the same sequences whatever the split, as training draws them."""


def replica_inputs(be, batch, replica: int, microbatches: int, size: int):
    """inputs(mb) → (idx, targets) of microbatch mb of replica `replica` as device arrays of
    backend `be`: rows [(replica · microbatches + mb) · size, + size) of `batch`, a host
    (idx, targets) pair of the whole global batch."""
    idx, targets = batch
    first = replica * microbatches

    def inputs(mb):
        rows = slice((first + mb) * size, (first + mb + 1) * size)
        return be.from_host(idx[rows]), be.from_host(targets[rows])
    return inputs
