package origin

import "github.com/redis/go-redis/v9"

// Every call is one script over the cells' hashes. A cell is one hash
// (keys.go) with the fields
//
//	t                 the region's total: every process's units
//	g                 what other regions counted (the cross-region role's
//	                  import, role.go)
//	n                 the number of process records below
//	r, rg             a reset's marks (reset.go): what t and g were when an
//	                  operator reset the key; what the cell says is t − r
//	                  and g − rg, so the units and imports from before the
//	                  reset never come back, however often they are written
//	<node>.<inc>      one record per process and incarnation of the cell in
//	                  it: that incarnation's own total, every unit it added
//	l                 "1" once a late write reached the previous cell (see
//	                  cellsLua): every answer about this cell then carries
//	                  the previous cell's totals
//
// A write carries the incarnation's own total for the cell (Own); the
// script raises the record to it and adds the difference to t. So a
// replayed flush, a lost reply, two overlapping writes (in either order)
// and a Redis restarted empty are no-ops or exact re-adds: nothing is
// subtracted and nothing counts twice, and it takes one round trip. A key a
// process forgets, evicts or replaces and makes again in the same window is
// a new incarnation (engine.Delta.Incarnation): its units add to the old
// record's instead of hiding below it, so what a process has added never
// shrinks. A warm write costs Redis two commands, HMGET of the cell and
// HSET of the record and the total, and a third, HMGET of the previous
// cell, until the process has that cell's final totals (a flush period and
// a write's bound into the window); the cell's expiry is set by the script that makes it, so a
// cell never exists without one.
//
// Counts saturate at 2^53 − 1 (engine.MaxCount): Lua numbers are doubles.
// Numbers go back to Redis through string.format('%d'), never as Lua
// numbers, which Redis would format with an exponent past 10^14.

// raiseLua defines raise(h, f, own, at): it raises the record f (node ID
// and incarnation) of the cell h to own (a decimal string), adds the
// difference to t (saturated), registers f when it is new (n + 1), sets the
// expiry at (Unix ms) when the cell is new, and returns the fields HMGET
// read (v: the record, t, g, n, r, rg, l as stored, nil where absent), t, the
// record and n as numbers, then t, the record and n as strings (t and g
// as stored: the cell says t − r and g − rg) and made, true when raise
// formatted t itself. text(v, mark) is what the stored count v says as a
// decimal string, mark (a reset's) taken off. Every script over cells
// begins with them.
//
// A number goes back as the string it came as where it is one: own, or
// what Redis holds, which these scripts wrote (cellsLua checks a stored
// string with text before it returns it, unless raise has just formatted
// it: made). Formatting was most of what a script spent on a cell beside
// its commands. Formatting every number, as before, a new cell cost Redis
// 8.3 µs of CPU and a warm write 7.0; returning strings as they are, 6.9
// and 5.6 (medians of seven rounds, the two builds alternated:
// BenchmarkFlushNewCells and BenchmarkFlush, redis-cpu-µs/cell). A new
// cell's four commands alone, with no script logic around them, take
// about 5.5. A warm write's HSET leaves n out (only a new record changes
// it) and its total is not checked again after raise formatted it: 10.4
// -> 9.6 µs a warm write, 13.9 -> 12.4 a new cell, on a slower host
// (Intel Xeon; seven rounds alternated, medians). Then the script logic
// was thinned (no helper call per number, a stored field converted only
// when present, one protected call per chunk, the reply's numbers put in
// one table): a warm write without the previous cell 3.78 -> 3.50 µs, a
// warm write 4.75 -> 4.57, a new cell 6.80 -> 6.12 (the same host on a
// quieter day; BenchmarkFlushNoPrev, BenchmarkFlush, BenchmarkFlushNewCells,
// five rounds alternated, medians), where a warm write's two commands
// with no logic around them take about 2.3.
// A new cell's n, which raise has just formatted, is returned as it is
// instead of checked again with text (a stored n still is): a new cell
// 11.00 -> 10.25 µs, a warm write 7.80 -> 7.62 and without the previous
// cell 6.16 -> 6.22 (unchanged within the noise), on a loaded AMD EPYC
// host (twelve rounds alternated, medians).
const raiseLua = `
local max = 9007199254740991
local fmt, tonumber, call, find = string.format, tonumber, redis.call, string.find
local function raise(h, f, own, at)
  local v = call('HMGET', h, f, 't', 'g', 'n', 'r', 'rg', 'l')
  local ms, ts, ns = v[1], v[2], v[4]
  local mine, t, n, made = 0, 0, 0, not ts
  if ms then mine = tonumber(ms) end
  if ts then t = tonumber(ts) end
  if ns then n = tonumber(ns) end
  local o = tonumber(own)
  if o > mine or not ms then
    local add = o - mine
    if add < 0 then add = 0 end
    if add > max - t then add = max - t end
    if add > 0 then
      t = t + add
      if t == o then ts = own else ts = fmt('%d', t) end
      made = true
    end
    ts = ts or '0'
    if ms then
      mine, ms = o, own
      call('HSET', h, f, ms, 't', ts)
    else
      if o > 0 then mine, ms = o, own else ms = '0' end
      n = n + 1
      ns = fmt('%d', n)
      call('HSET', h, f, ms, 't', ts, 'n', ns)
    end
    if not v[2] then call('PEXPIREAT', h, at) end
  end
  return v, t, mine, n, ts or '0', ms, ns or '0', made
end
local function text(v, mark)
  if mark then return fmt('%d', math.max(tonumber(v or '0') - tonumber(mark), 0)) end
  if not v then return '0' end
  if #v < 16 and find(v, '^%d+$') then return v end
  return fmt('%d', math.min(math.max(tonumber(v), 0), max))
end
`

// cellsLua runs raise over a chunk of cells (a single cell in a Cluster,
// where the cells of different keys lie in different slots; see many.go),
// with each cell's previous cell, for reads (own 0: the read registers the
// process, so two processes that start on one key at once see each other
// at their first round trip, before either has replayed a unit) and writes
// alike: a replay refreshes everything a decision weighs, as a read would,
// but the previous cell when the process has its final totals
// (engine.Delta.NoPrev: flag 0), which saves a command a write. Those
// totals are final only if every process's units of the previous cell
// arrived in time: a write that comes later than that (engine.Delta.Late:
// units held through an outage, or by a process that ran without Redis
// for a while) marks the cell after it (l), and every answer about a
// marked cell carries the previous cell's totals again, so that the
// processes that had settled it weigh the late units from their next round
// trip on, instead of never in that window. A cell
// whose commands Redis refuses (a key holding another type) fails alone:
// the chunk runs under one protected call, and when that fails it runs
// again with one per cell. Running a cell twice is harmless, as every
// write is: the second run finds its record raised and changes nothing.
// So does a cell Redis refuses for want of memory (OOM, under
// noeviction: its units stay pending until Redis has room). Any other
// refusal with a code (READONLY from a replica, NOPERM, MISCONF,
// NOREPLICAS) is Redis refusing every write, whatever the key: the call
// fails with it, as a command outside a script would, so that the
// breaker counts it and go-redis drops a connection that answered
// READONLY (the name it dialled may lead to the new master now). Caught
// cell by cell, READONLY once read as "refused cells": the breakers
// stayed closed and the pool kept writing to a replica.
//
//	KEYS per cell in order: the cell, then, when its flags have 1, the
//	cell before it (a write that leaves the previous cell out names only
//	its own: a key less to build, send and parse), then, when they have 2,
//	the cell after it, which a late write marks (the previous cell of a
//	marked cell is named by no flag: the script derives its key)
//	ARGV[1] node ID, ARGV[2] "<incarnation> <Own> <expiry> <flags> …",
//	four numbers per cell, decimal; flags 1 reads the previous cell, 2
//	marks the next one (cellFlags), 3 both
//	returns one string, per cell in order either "<t> <previous t> <the
//	record> <n> <g> <previous g>" or "e", separated by spaces: one bulk
//	reply the client reads without a value per number
const cellsLua = raiseLua + `
local function cell(h, p, nx, f, own, at)
  local v, t, mine, n, ts, ms, ns, made = raise(h, f, own, at)
  local r, g = v[5], v[3]
  if r and tonumber(r) > 0 then ts = fmt('%d', math.max(t - tonumber(r), 0)) elseif not made then ts = text(ts) end
  if ms ~= own then ms = text(ms) end
  local gs, pt, pg = '0', '0', '0'
  if g and tonumber(g) > 0 then gs = fmt('%d', math.max(tonumber(g) - tonumber(v[6] or '0'), 0)) end
  if not p and v[7] then
    -- A late write reached the previous cell: read it whatever the flags.
    local stem, seq = string.match(h, '^(.*:)(%d+):c$')
    if stem then p = stem .. fmt('%d', tonumber(seq) - 1) .. ':c' end
  end
  if p then
    local pv = call('HMGET', p, 't', 'g', 'r', 'rg')
    pt, pg = text(pv[1], pv[3]), text(pv[2], pv[4])
  end
  if nx then
    call('HSET', nx, 'l', '1')
    if call('PTTL', nx) == -1 then call('PEXPIREAT', nx, at) end
  end
  if ns == v[4] then ns = text(ns) end
  return ts, pt, ms, ns, gs, pg
end
local node, out, fatal = ARGV[1] .. '.', {}, nil
local function run(each)
  local o, k = 0, 1
  for inc, own, at, fl in string.gmatch(ARGV[2], '(%d+) (%d+) (%d+) (%d)') do
    local h, p, nx = KEYS[k], nil, nil
    k = k + 1
    if fl == '1' or fl == '3' then p, k = KEYS[k], k + 1 end
    if fl == '2' or fl == '3' then nx, k = KEYS[k], k + 1 end
    if each then
      local ok, a, b, c, d, e, f = pcall(cell, h, p, nx, node .. inc, own, at)
      if ok then
        out[o+1], out[o+2], out[o+3], out[o+4], out[o+5], out[o+6] = a, b, c, d, e, f
        o = o + 6
      else
        local why = a
        if type(why) == 'table' then why = why.err end
        why = tostring(why)
        local code = string.match(why, '^(%u+) ')
        if code and code ~= 'WRONGTYPE' and code ~= 'OOM' and code ~= 'ERR' then
          fatal = why
          return o
        end
        o = o + 1
        out[o] = 'e'
      end
    else
      out[o+1], out[o+2], out[o+3], out[o+4], out[o+5], out[o+6] = cell(h, p, nx, node .. inc, own, at)
      o = o + 6
    end
  end
  return o
end
local ok, o = pcall(run, false)
if not ok then
  out = {}
  o = run(true)
  if fatal then return redis.error_reply(fatal) end
end
return table.concat(out, ' ', 1, o)
`

// reserveLua is a write (as cellsLua's, for one cell) followed by the
// decisions of one or more requests (a group) against the region's count
// and the imported counts, each charged in the same step when it passes,
// in order, as if they came one after another:
//
//	cur + imported + cost + ⌊(prev + importedPrev) × (w − elapsed) / w⌋ ≤ limit
//
// (the previous cell's weight rounded down, as the engine rounds it),
// evaluated as (prev + importedPrev) × (w − elapsed) < (limit − cur −
// imported − cost + 1) × w, where cur includes the costs admitted before.
// The imported counts are the larger of what the engine sent and what the
// cells hold (g). The products are doubles: exact while they stay below
// 2^53 (say a count of a million over a window of a day), within one part
// in 2^53 beyond. The costs admitted sum to at most the limit, so nothing
// here passes 2^53 − 1.
//
//	KEYS[1] cell, KEYS[2] the previous cell
//	ARGV[1] record (node ID.incarnation), ARGV[2] Own, ARGV[3] expiry
//	(Unix ms), ARGV[4] the costs, decimal, separated by spaces, ARGV[5]
//	limit, ARGV[6] window ms, ARGV[7] elapsed ms, ARGV[8] imported count
//	(engine.Reservation.Global), ARGV[9] imported count of the previous cell
//	returns {one verdict per cost as a string of "1" (admitted) and "0",
//	t, previous t, the record, n, g, previous g}
const reserveLua = raiseLua + `
local v, t, mine, n = raise(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
local g, rt, rg = tonumber(v[3] or '0'), tonumber(v[5] or '0'), tonumber(v[6] or '0')
local pv = call('HMGET', KEYS[2], 't', 'g', 'r', 'rg')
local pt = math.max(tonumber(pv[1] or '0') - tonumber(pv[3] or '0'), 0)
local pg = math.max(tonumber(pv[2] or '0') - tonumber(pv[4] or '0'), 0)
local limit = tonumber(ARGV[5])
local w, r = tonumber(ARGV[6]), tonumber(ARGV[7])
local gv = math.max(g - rg, 0)
local imported = math.max(tonumber(ARGV[8]), gv)
local weighed = math.min(pt + math.max(tonumber(ARGV[9]), pg), max)
local verdicts, charged = {}, 0
for c in string.gmatch(ARGV[4], '%d+') do
  local cost = tonumber(c)
  local room = limit - math.min(math.max(t - rt, 0) + charged + imported, max) - cost
  if room >= 0 and (weighed == 0 or r >= w or weighed * (w - r) < (room + 1) * w) then
    charged = charged + cost
    verdicts[#verdicts + 1] = '1'
  else
    verdicts[#verdicts + 1] = '0'
  end
end
if charged > 0 then
  local add = charged
  if add > max - t then add = max - t end
  t = t + add
  mine = math.min(mine + charged, max)
  redis.call('HSET', KEYS[1], ARGV[1], string.format('%d', mine), 't', string.format('%d', t))
end
return {table.concat(verdicts), math.max(t - rt, 0), pt, mine, n, gv, pg}
`

// source is what a call of cellsScript sends instead of its hash: its
// source when eval (Redis lost the script), else nothing (EVALSHA).
func source(eval bool) string {
	if eval {
		return cellsLua
	}
	return ""
}

var (
	cellsScript   = redis.NewScript(cellsLua)
	reserveScript = redis.NewScript(reserveLua)
)
