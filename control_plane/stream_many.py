"""The chunks and the whole response of a request run as several sequences (a `FanOut`), with
echo, log-probabilities and tool calls where asked (see control_plane/serving.py)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from control_plane.fanout import FanOut, Job
from control_plane.responses import ResponseBuilder, usage


def _index(job: Job, body) -> int:
    return job.prompt_index * body.num_choices + job.candidate


def _echo_text(api, body, job: Job) -> str:
    prompts = body.prompts()
    prompt = prompts[job.prompt_index]
    return prompt if isinstance(prompt, str) else api.gateway.tokenizer.decode(
        prompt, skip_special_tokens=False)


def _wants_logprobs(body) -> bool:
    value = getattr(body, "logprobs", None)
    return value is not None and value is not False  # completions' 0 asks for them


class _ChoiceStream:
    """One choice's place in a stream: echo not yet sent, its text offset, its tool parser."""

    def __init__(self, api, body, job: Job, prepared) -> None:
        self.api, self.body, self.job = api, body, job
        self.echo_pending = bool(getattr(body, "echo", False))
        self.offset = 0
        self.tools = prepared.tools.streamer() if prepared.tools is not None else None

    def chunks(self, builder: ResponseBuilder, event) -> list[dict]:
        text = event.text
        if self.echo_pending:
            text = _echo_text(self.api, self.body, self.job) + text
        logprobs = self._logprobs(event) if _wants_logprobs(self.body) else None
        self.echo_pending = False
        index = _index(self.job, self.body)
        if self.tools is None:
            return [builder.chunk(text, event.finish_reason, None, index, logprobs)]
        out = [builder.chunk(delta.get("content", ""), None, None, index,
                             tool_calls=delta.get("tool_calls"))
               for delta in self.tools.feed(text)]
        if event.finish_reason is not None:
            out += [builder.chunk(delta.get("content", ""), None, None, index,
                                  tool_calls=delta.get("tool_calls"))
                    for delta in self.tools.flush()]
            finish = "tool_calls" if self.tools.called else event.finish_reason
            out.append(builder.chunk("", finish, None, index))
        return out

    def _logprobs(self, event) -> dict:
        formatter = self.api.formatter
        if builder_is_chat(self.body):
            return formatter.chat(event.logprobs)
        ids, entries = list(event.token_ids), list(event.logprobs)
        if self.echo_pending:
            prompt = self.job.prompt_ids
            ids, entries = prompt + ids, [None] + list(self.job.prompt_logprobs) + entries
        body, self.offset = formatter.completion(entries, ids, self.offset)
        return body


def builder_is_chat(body) -> bool:
    return hasattr(body, "messages")


async def stream_lines(api, run: FanOut, builder: ResponseBuilder, body, prepared):
    from control_plane.serving import sse, stream_error

    options = body.stream_options
    streams = {id(job): _ChoiceStream(api, body, job, prepared) for job in run.jobs}
    try:
        async for job, event in run.events():
            if event.error:
                yield sse(stream_error(event))
                break
            for chunk in streams[id(job)].chunks(builder, event):
                yield sse(chunk)
        else:
            if options and options.include_usage:
                yield sse(builder.usage_chunk(_usage(run.jobs)))
        yield sse("[DONE]")
    finally:
        run.close()


def _usage(jobs: list[Job]) -> dict:
    prompts = {job.prompt_index: len(job.prompt_ids) for job in jobs}
    generated = sum(job.last.num_output_tokens for job in jobs if job.last is not None)
    return usage(sum(prompts.values()), generated)


def _chosen(jobs: list[Job], body) -> list[Job]:
    """Per prompt, the n best candidates by cumulative log-probability (all when best_of is
    not larger than n), best first."""
    if body.num_candidates == body.num_choices:
        return jobs
    chosen = []
    for k in sorted({job.prompt_index for job in jobs}):
        ranked = sorted((j for j in jobs if j.prompt_index == k),
                        key=lambda j: j.cumulative_logprob, reverse=True)
        for rank, job in enumerate(ranked[:body.num_choices]):
            job.candidate = rank
            chosen.append(job)
    return chosen


def whole_response(api, run: FanOut, builder: ResponseBuilder, body, prepared) -> JSONResponse:
    from control_plane.serving import failed_job, failed_response

    failed = failed_job(run.jobs)
    if failed is not None:
        return failed_response(failed.last)
    choices = [_choice(api, builder, body, prepared, job) for job in _chosen(run.jobs, body)]
    choices.sort(key=lambda c: c["index"])
    return JSONResponse(builder.response_of(choices, _usage(run.jobs)))


def _choice(api, builder: ResponseBuilder, body, prepared, job: Job) -> dict:
    text, finish = job.text, job.last.finish_reason
    logprobs = None
    if _wants_logprobs(body):
        if builder.chat:
            logprobs = api.formatter.chat(job.logprobs)
        else:
            ids, entries = job.token_ids, job.logprobs
            if getattr(body, "echo", False):
                ids, entries = job.prompt_ids + ids, [None] + job.prompt_logprobs + entries
            logprobs, _ = api.formatter.completion(entries, ids)
    if getattr(body, "echo", False):
        text = _echo_text(api, body, job) + text
    tool_calls = None
    if prepared.tools is not None:
        text, tool_calls = prepared.tools.parse(text)
        finish = "tool_calls" if tool_calls else finish
    return builder.choice(text, finish, _index(job, body), logprobs, tool_calls or None)
