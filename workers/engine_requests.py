"""The engine's live requests, and the lines each engine call reports about them.

One owner for a request's life inside the engine (one owner each): a request enters, its
sequences end (a `finish` line once the last text is out, the blocks back to the scheduler at
once), or it fails (one `error` line); once none of its sequences is live it retires (a normal end
sends `usage`) and its id is free again. The engine decides when; this table keeps the books.

Each engine call collects its lines per request in one dict (`begin` … `retire`); lines made
between calls (a continuation that was already over when it arrived) wait for the next call.
"""

from __future__ import annotations

from wire import api
from workers.engine_outputs import RequestOutput
from workers.request import FINISH_REASON, Request, RequestStatus, SequenceState
from workers.scheduler import Scheduler

Outputs = dict[str, RequestOutput]  # one engine call's lines, by request id


def output_of(outputs: Outputs, request_id: str) -> RequestOutput:
    """The request's output in this call, started when it has none yet."""
    if request_id not in outputs:
        outputs[request_id] = RequestOutput(request_id)
    return outputs[request_id]


class LiveRequests:
    """The requests the engine holds, by id, until each retires."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._requests: dict[str, Request] = {}
        self._early: Outputs = {}  # made between calls, out with the next one
        self._ending: set[str] = set()  # requests a sequence of which ended in this call

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __getitem__(self, request_id: str) -> Request:
        return self._requests[request_id]

    def __bool__(self) -> bool:
        return bool(self._requests)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def ids(self) -> list[str]:
        return list(self._requests)

    def add(self, req: Request) -> None:
        self._requests[req.request_id] = req

    def early(self, request_id: str) -> RequestOutput:
        """The request's output before the next call (add_request's own lines)."""
        return output_of(self._early, request_id)

    def begin(self) -> Outputs:
        """One call's outputs, starting with those made since the last call."""
        outputs, self._early = self._early, {}
        return outputs

    def end_sequence(self, seq: SequenceState, status: RequestStatus, out: RequestOutput) -> None:
        """The `finish` line, once the sequence's last text is out."""
        if status == RequestStatus.FINISHED_STOPPED and seq.tool_calls_sent:
            status = RequestStatus.FINISHED_TOOL_CALLS
        seq.status = status
        line = api.FinishLine(FINISH_REASON[status], seq.index, seq.num_output_tokens)
        if status == RequestStatus.FINISHED_STOPPED and seq.hit_stop_string:
            line.stop_string = seq.holdback.matched
        out.events.append(line)
        self.release(seq)

    def release(self, seq: SequenceState) -> None:
        """A sequence that ended gives its blocks back now; its request is looked at on retire."""
        self.scheduler.release(seq)
        self._ending.add(seq.request_id)

    def fail(self, request_id: str, code: str, message: str, outputs: Outputs) -> None:
        """Every sequence of the request ends, and one `error` line says why."""
        req = self._requests[request_id]
        if req.status == RequestStatus.FINISHED_ERROR:  # one error line per request
            return
        for seq in req.sequences:
            seq.status = RequestStatus.FINISHED_ERROR
            self.release(seq)
        req.status = RequestStatus.FINISHED_ERROR
        out = output_of(outputs, request_id)
        out.events.append(api.ErrorLine(code, message))
        out.finished = True

    def retire(self, outputs: Outputs) -> list[RequestOutput]:
        """Requests whose sequences are all done leave the engine; a normal end sends usage.
        Only the requests a sequence of which ended since the last call are looked at. Returns
        the call's outputs."""
        ending, self._ending = self._ending, set()
        for request_id in ending:
            req = self._requests.get(request_id)
            if req is None:
                continue
            if req.status != RequestStatus.FINISHED_ERROR:
                if req.live_sequences():
                    continue
                req.status = max(s.status for s in req.sequences)
                out = output_of(outputs, request_id)
                out.events.append(api.UsageLine(len(req.prompt_ids), req.completion_tokens))
                out.finished = True
            del self._requests[request_id]
        return list(outputs.values())
