"""The Lua scripts of the Redis run store, and the batch that applies a tick's writes at once.

Each script reads, decides and writes in one step on the Redis side, so "append only while
live" and "the one terminal transition" hold across replicas without read-modify-write races.
`APPLY` runs the append, finish, advance and follower-count scripts as functions, in order, for
a whole write-behind tick: one command and one reply however many runs wrote.
"""

from __future__ import annotations

from typing import Any

from gateway.runs.status import RunStatus
from gateway.state.run_store import Chunk

TERMINAL = int(RunStatus.COMPLETED)

# NOTE: appends and the ending name their seq numbers (0: "the next ones"), and skip any the log
# already has, so the owner's write-behind can send a batch again after a lost connection
# without doubling events. KEYS: run hash, events stream, notify channel
# ARGV: max_events, first seq (0: next), the events packed in one string (`pack_events`): per
# event "<payload bytes> <choice index> <text bytes> " then the payload, then the text, where
# the index is -1 for an event that is not a plain text delta. One argument for a run's events,
# not three each: what the client packs and Redis parses per argument is what a tick costs.
APPEND = """
local state = redis.call('HMGET', KEYS[1], 'status', 'last_seq')
if not state[1] then return -1 end
if tonumber(state[1]) >= TERMINAL then return -2 end
local last = tonumber(state[2])
local seq = tonumber(ARGV[2]) - 1
if seq < 0 then seq = last end
local packed, at = ARGV[3], 1
while at <= #packed do
  local _, head, size, index, text_size = string.find(packed, '^(%d+) (%-?%d+) (%d+) ', at)
  local body = head + tonumber(size)
  at = body + tonumber(text_size) + 1
  seq = seq + 1
  if seq > last then
    local id, payload = seq .. '-0', string.sub(packed, head + 1, body)
    if index == '-1' then
      redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[1], id, 'd', payload)
    else
      local text = string.sub(packed, body + 1, at - 1)
      redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[1], id, 'd', payload, 't', text, 'i', index)
    end
  end
end
if seq > last then
  redis.call('HSET', KEYS[1], 'last_seq', seq)
  redis.call('PUBLISH', KEYS[3], seq)
end
return seq
""".replace("TERMINAL", str(TERMINAL))

# The one terminal transition; a repeat of the same ending (a write-behind retry) is its win.
# KEYS: run hash, events stream, notify channel, followers hash
# ARGV: status, terminal json, retention ms, max_events[, final seq (0: next), final payload]
FINISH = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if tonumber(status) >= TERMINAL then
  if redis.call('HGET', KEYS[1], 'terminal') == ARGV[2] then return 1 end
  return 0
end
if #ARGV >= 6 then
  local last = tonumber(redis.call('HGET', KEYS[1], 'last_seq'))
  local seq = tonumber(ARGV[5])
  if seq == 0 then seq = last + 1 end
  if seq > last then
    redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[4], seq .. '-0', 'd', ARGV[6])
    redis.call('HSET', KEYS[1], 'last_seq', seq)
  end
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'terminal', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[4], ARGV[3])
redis.call('PUBLISH', KEYS[3], 'end')
return 1
""".replace("TERMINAL", str(TERMINAL))

# KEYS: run hash; ARGV: new status
ADVANCE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
status = tonumber(status)
local new = tonumber(ARGV[1])
if status >= TERMINAL or new >= TERMINAL or new <= status then return 0 end
redis.call('HSET', KEYS[1], 'status', new)
return 1
""".replace("TERMINAL", str(TERMINAL))

# A new run's record, refused (0) if the run id is taken. KEYS: run hash
# ARGV: ttl s, then field, value pairs
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

# A replica's own follower count, absolute (so a retry cannot count twice); returns the sum
# over replicas. KEYS: run hash, followers hash; ARGV: replica, count, ttl s
FOLLOWERS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if tonumber(ARGV[2]) > 0 then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  if redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], ARGV[3]) end
else
  redis.call('HDEL', KEYS[2], ARGV[1])
end
local total = 0
for _, n in ipairs(redis.call('HVALS', KEYS[2])) do total = total + tonumber(n) end
return total
"""

# Every write of a write-behind tick in one call: the scripts above as functions, applied in
# order. KEYS: each call's keys in turn; ARGV: per call its code, key count, arg count, args.
# Returns each call's own answer, in order.
APPLY = (
    "local calls = {}\n"
    + "".join(
        f"calls['{code}'] = function(KEYS, ARGV)\n{body}\nend\n"
        for code, body in (("a", APPEND), ("f", FINISH), ("v", ADVANCE), ("c", FOLLOWERS))
    )
    + """
local answers, k, i = {}, 1, 1
while i <= #ARGV do
  local nkeys, nargs = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local keys, args = {}, {}
  for j = 1, nkeys do keys[j] = KEYS[k + j - 1] end
  for j = 1, nargs do args[j] = ARGV[i + 2 + j] end
  answers[#answers + 1] = calls[ARGV[i]](keys, args)
  k, i = k + nkeys, i + 3 + nargs
end
return answers
"""
)


def pack_events(chunks: list[Chunk]) -> bytes:
    """A run's events as the append script's one packed argument."""
    parts: list[bytes] = []
    for payload, text, index in chunks:
        if text is None:
            parts += (b"%d -1 0 " % len(payload), payload)
        else:
            encoded = text.encode()
            parts += (b"%d %d %d " % (len(payload), index, len(encoded)), payload, encoded)
    return b"".join(parts)


class ScriptBatch:
    """Script calls gathered for one call of the apply script: one command and one reply for a
    whole tick of writes, where a call each would cost a command and a reply parsed each."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.args: list[Any] = []
        self.count = 0

    def add(self, code: str, keys: list[str], args: list[Any]) -> int:
        """Queue a call; its index among the answers."""
        self.keys += keys
        self.args += [code, len(keys), len(args), *args]
        self.count += 1
        return self.count - 1
