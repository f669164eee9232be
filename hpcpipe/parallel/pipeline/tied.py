"""The tied embedding's gradient: d(wte) = embedding part + head part, on both holders
(a tied Llama's model.embed_tokens.weight the same way; an untied head has none).

The head reuses the token embedding `wte` as its weight. In a pipeline the first stage
(embedding) and the last (head) each hold a copy; each step both copies must receive the
same summed gradient, embedding part + head part, in that order on every layout, so that
the two copies stay equal and the numbers do not depend on the pipeline (design contract).

Where both parts are on one rank (pp = 1, or ZB-V's V that starts and ends on rank 0) the
sum is local. Otherwise the two ranks exchange their parts point to point, as soon as
each is complete: the head's right after the last stage's last B (the head's weight
gradient is taken in B), the sum back from the first stage after its last W. A message
needs no progress from its sender once the receive is posted, unlike a two-rank
all-reduce, so neither stage waits for the other to enter MPI. When the transport stages
through host memory the two parts are summed by one all-reduce at the end instead.
"""

from __future__ import annotations

from hpcpipe.schedules.ops import Kind


class TiedEmbedding:
    """This rank's part in summing d(wte), for the stages it holds (chunk → Stage).

    ends: the Grid's communicator of the pipeline's first and last rank (None elsewhere);
    embedding_rank, head_rank: the pipeline ranks holding the first and the last stage."""

    def __init__(self, stages: dict, ends, embedding_rank: int, head_rank: int, transport):
        from mpi4py import MPI

        self.MPI, self.transport = MPI, transport
        self.embedding = next((s for s in stages.values() if s.embedding_part), None)
        self.head = next((s for s in stages.values() if s.head_part), None)
        # The two ranks that hold a copy of wte sum their gradients over their own
        # communicator (none when one rank holds both: pp = 1, ZB-V).
        self.comm = ends if embedding_rank != head_rank else None
        # Point to point only where MPI can take the arrays as they are.
        self.exchanges = self.comm is not None and not transport.staged
        holder = self.embedding or self.head
        # The tensor both ends hold ("wte", a Llama's embed_tokens), or None: an untied
        # head (a Llama's lm_head), whose stages have nothing to sum.
        self.name = holder.tied if holder is not None else None
        if self.name is None:
            self.comm, self.exchanges = None, False
        self._buffer = None
        self._send = self._recv = None
        self._started = False
        self.bytes_sent = 0  # the tied gradient's exchange, for the benchmark

    @property
    def head_only(self) -> bool:
        """This rank holds the head's copy but not the embedding's."""
        return self.head is not None and self.embedding is None

    def begin_step(self):
        """Before the step's schedule: the last step's sum must be out, and the embedding's
        rank posts its receive of the head's part ahead."""
        if self._send is not None:
            self._send.Wait()
            self._send = None
        if self.exchanges and self.embedding is not None:
            self._start()

    def op_done(self, stage, kind: Kind, last_microbatch: bool):
        """After every op of the schedule: the head's part is complete after its last B."""
        if (self.exchanges and last_microbatch and stage is self.head and self.head_only
                and kind in (Kind.B, Kind.BW)):
            self._start()

    def _start(self):
        """Post this step's exchange (`begin_step` has waited for the last step's send)."""
        if self._started:
            return
        holder = self.embedding or self.head
        if self._buffer is None:
            xp = holder.be.xp
            self._buffer = xp.empty(holder.params[self.name].shape, holder.grad_dtype)
        self._started = True
        wire = self.transport.wire
        if self.embedding is not None:  # (the last step's send of the buffer is done)
            self._recv = self.comm.Irecv(wire(self._buffer), source=1, tag=0)
        else:
            self.transport.ready()
            self._recv = self.comm.Irecv(wire(self._buffer), source=0, tag=1)
            self._send = self.comm.Isend(wire(self.head.head_grad), dest=0, tag=0)

    def finish(self):
        """After the step's schedule: d(wte) = embedding part + head part, on every holder."""
        emb, head, name = self.embedding, self.head, self.name
        if name is None:  # untied: no copies to sum
            return
        if emb is not None and head is not None:
            if emb is head:
                emb.add_head_grad()
            else:  # ZB-V: both ends of the V on this rank
                emb.add_head_grad(head.head_grad)
                head.grads[name][...] = emb.grads[name]
            return
        if emb is None and head is None:  # a middle stage holds no copy
            return
        part = emb.grads[name] if emb is not None else head.head_grad
        self.bytes_sent += int(part.nbytes)  # either way each holder sends one a step
        if not self._started:  # not exchanged early (host staging, or no hooks ran)
            total = self.transport.allreduce_sum(self.comm, part,
                                                 what="the tied embedding's sum")
            if head is not None:
                head.grads[name][...] = total
            return
        self._started = False
        beacon = self.transport.beacon
        if emb is not None:
            # The head's part came while this stage ran its W's; add it (E + H, the bits
            # an all-reduce of the two would give) and send the sum back.
            beacon.collective(self.comm, "the tied embedding's sum")
            self._recv.Wait()
            beacon.done()
            emb.grads[name] += self._buffer
            # Send a copy: the data-parallel reduction works on grads[name] in place next.
            self._buffer[...] = emb.grads[name]
            self.transport.ready()
            self._send = self.comm.Isend(self.transport.wire(self._buffer), dest=1, tag=1)
        else:
            beacon.collective(self.comm, "the tied embedding's sum")
            self.MPI.Request.Waitall([self._send, self._recv])
            beacon.done()
            self._send = None
            head.grads[name][...] = self._buffer
