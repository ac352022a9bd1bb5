-- wrk script of the load harness (scripts/loadtest.sh).
--
-- Counts responses by status code, so the harness can check that every
-- scenario answered what it should (200s for allow, 429s for deny), and
-- prints one machine-readable "LT ..." summary at the end.
--
-- With LT_KEYS=N set, every request carries "X-Key: k<i>", i cycling through
-- N distinct values starting at LT_KEY_START (so successive runs continue
-- where the previous one stopped); LT_KEY_PREFIX replaces the "k". Without it, requests are static (wrk's
-- fastest path) and carry no X-Key header.

local keys = tonumber(os.getenv("LT_KEYS") or "")
local start = tonumber(os.getenv("LT_KEY_START") or "") or 0
local prefix = os.getenv("LT_KEY_PREFIX") or "k"

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

-- Per thread (each wrk thread has its own Lua state).
counts = {}
calls = 0

function init(args)
  counts = {}
  calls = 0
end

if keys then
  function request()
    local k = (start + calls) % keys
    calls = calls + 1
    return wrk.format(nil, nil, { ["X-Key"] = prefix .. k })
  end
end

function response(status, headers, body)
  counts[status] = (counts[status] or 0) + 1
end

function done(summary, latency, requests)
  local total, sent = {}, 0
  for _, t in ipairs(threads) do
    for code, n in pairs(t:get("counts")) do
      total[code] = (total[code] or 0) + n
    end
    sent = sent + (t:get("calls") or 0)
  end
  local codes = {}
  for code, n in pairs(total) do
    table.insert(codes, code .. ":" .. n)
  end
  table.sort(codes)
  local e = summary.errors
  io.write(string.format(
    "LT requests=%d duration_us=%d p50_us=%d p99_us=%d sock_errors=%d connect=%d read=%d write=%d timeout=%d non2xx3xx=%d keyed_sent=%d codes=%s\n",
    summary.requests, summary.duration,
    latency:percentile(50.0), latency:percentile(99.0),
    e.connect + e.read + e.write + e.timeout,
    e.connect, e.read, e.write, e.timeout, e.status, sent,
    table.concat(codes, ",")))
end
