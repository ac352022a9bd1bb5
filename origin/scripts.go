package origin

import "github.com/redis/go-redis/v9"

// Every write is one script, so that replay and reservation are idempotent.
// A cell <cell> has a contribution hash <cell>:own with one field per
// process and incarnation of the cell in it, <node ID>.<incarnation>: that
// incarnation's own total, every unit it has added. A write carries the
// incarnation's own total for the cell (Own); the script raises the field
// to it and adds the difference to the cell. So a replayed flush,
// a lost reply, two overlapping writes (in either order) and a Redis
// restarted empty are no-ops or exact re-adds: nothing is subtracted and
// nothing counts twice, and it takes one round trip. A key a process
// forgets, evicts or replaces and makes again in the same window is a new
// incarnation (engine.Delta.Incarnation): its units add to the old field's
// instead of hiding below it, so what a process has added never shrinks.
//
// Counts saturate at 2^53 − 1 (engine.MaxCount): Lua numbers are doubles.
// Numbers go back to Redis through string.format('%d'), never as Lua
// numbers, which Redis would format with an exponent past 10^14.

// raiseLua defines raise(k, h, node, own): it raises the field node (the
// node ID and the incarnation) of the contribution hash h of cell k to the
// own total own (a decimal string) and adds the difference to the cell
// (saturated), and returns the cell's total and the field. Every write
// script begins with it.
const raiseLua = `
local max = 9007199254740991
local function raise(k, h, node, own)
  local mine = tonumber(redis.call('HGET', h, node) or '0')
  local n = tonumber(own)
  local total = tonumber(redis.call('GET', k) or '0')
  if n > mine then
    local add = n - mine
    if add > max - total then add = max - total end
    if add > 0 then total = redis.call('INCRBY', k, string.format('%d', add)) end
    redis.call('HSET', h, node, own)
    mine = n
  end
  return total, mine
end
`

// reserveLua is a write (as writeLua's, for one cell) followed by the
// decisions of one or more requests (a group) against the region's count
// and the imported counts, each charged in the same step when it passes,
// in order, as if they came one after another:
//
//	cur + imported + cost + ⌊(prev + importedPrev) × (w − elapsed) / w⌋ ≤ limit
//
// (the previous cell's weight rounded down, as the engine rounds it),
// evaluated as (prev + importedPrev) × (w − elapsed) < (limit − cur −
// imported − cost + 1) × w, where cur includes the costs admitted before. The products
// are doubles: exact while they stay below 2^53 (say a count of a million
// over a window of a day), within one part in 2^53 beyond. The costs
// admitted sum to at most the limit, so nothing here passes 2^53 − 1.
//
//	KEYS[1] cell, KEYS[2] its contribution hash, KEYS[3] the previous cell
//	ARGV[1] field (node ID.incarnation), ARGV[2] Own, ARGV[3] expiry (Unix ms), ARGV[4] the
//	costs, decimal, separated by spaces, ARGV[5] limit, ARGV[6] window ms,
//	ARGV[7] elapsed ms, ARGV[8] imported count (engine.Reservation.Global),
//	ARGV[9] imported count of the previous cell
//	returns {one verdict per cost as a string of "1" (admitted) and "0",
//	cell total, previous cell total, this process's field, processes in
//	the hash}
const reserveLua = raiseLua + `
local total, mine = raise(KEYS[1], KEYS[2], ARGV[1], ARGV[2])
local prev = tonumber(redis.call('GET', KEYS[3]) or '0')
local limit = tonumber(ARGV[5])
local w, r = tonumber(ARGV[6]), tonumber(ARGV[7])
local imported = tonumber(ARGV[8])
local weighed = math.min(prev + tonumber(ARGV[9]), max)
local verdicts, charged = {}, 0
for c in string.gmatch(ARGV[4], '%d+') do
  local cost = tonumber(c)
  local room = limit - math.min(total + charged + imported, max) - cost
  if room >= 0 and (weighed == 0 or r >= w or weighed * (w - r) < (room + 1) * w) then
    charged = charged + cost
    verdicts[#verdicts + 1] = '1'
  else
    verdicts[#verdicts + 1] = '0'
  end
end
if charged > 0 then
  local add = charged
  if add > max - total then add = max - total end
  if add > 0 then total = redis.call('INCRBY', KEYS[1], string.format('%d', add)) end
  mine = redis.call('HINCRBY', KEYS[2], ARGV[1], string.format('%d', charged))
end
redis.call('PEXPIREAT', KEYS[1], ARGV[3])
redis.call('PEXPIREAT', KEYS[2], ARGV[3])
return {table.concat(verdicts), total, prev, mine, redis.call('HLEN', KEYS[2])}
`

// writeLua raises this process's own total in each of its cells, and
// returns each previous cell's total too, so that a replay refreshes
// everything a decision weighs, as a read would. One call carries a chunk
// of cells (a single cell in a Cluster, where the cells of different keys
// lie in different slots; see many.go). A cell whose commands Redis
// refuses (a key holding another type) fails alone.
//
//	KEYS[3i+1] cell i, KEYS[3i+2] its contribution hash, KEYS[3i+3] the
//	cell before it (i from 0)
//	ARGV[1] node ID, ARGV[2] "<incarnation> <Own> <expiry> …", one triple
//	per cell, decimal
//	returns one string, per cell in order either "<cell total> <this
//	process's field> <processes in the hash> <previous cell total>" or
//	"e", separated by spaces: one bulk reply the client reads without a
//	value per number
const writeLua = raiseLua + `
local node, out, i = ARGV[1] .. '.', {}, 0
for inc, own, at in string.gmatch(ARGV[2], '(%d+) (%d+) (%d+)') do
  local k, h, p = KEYS[3*i+1], KEYS[3*i+2], KEYS[3*i+3]
  local ok, res = pcall(function()
    local total, mine = raise(k, h, node .. inc, own)
    redis.call('PEXPIREAT', k, at)
    redis.call('PEXPIREAT', h, at)
    return string.format('%d %d %d %d', total, mine, redis.call('HLEN', h), tonumber(redis.call('GET', p) or '0'))
  end)
  i = i + 1
  out[i] = ok and res or 'e'
end
return table.concat(out, ' ')
`

// readLua reads each of its cells and the cell before it, and registers
// this process in the cell's contribution hash (a field of 0 units) if it
// is not there yet: two processes that start on one key at once then see
// each other at their first round trip, before either has replayed a unit.
// It takes chunks of cells as writeLua does; a cell whose commands Redis
// refuses fails alone.
//
//	KEYS[3i+1] cell i, KEYS[3i+2] its contribution hash, KEYS[3i+3] the
//	cell before it (i from 0)
//	ARGV[1] node ID, ARGV[2] "<incarnation> <expiry> …", one pair per cell
//	returns one string, per cell in order either "<cell total> <previous
//	cell total> <this process's field> <processes in the hash>" or "e",
//	separated by spaces
const readLua = `
local node, out, i = ARGV[1] .. '.', {}, 0
for inc, at in string.gmatch(ARGV[2], '(%d+) (%d+)') do
  local k, h, p = KEYS[3*i+1], KEYS[3*i+2], KEYS[3*i+3]
  local ok, res = pcall(function()
    local f = node .. inc
    local mine = redis.call('HGET', h, f)
    if not mine then
      redis.call('HSET', h, f, '0')
      redis.call('PEXPIREAT', h, at)
      mine = '0'
    end
    return string.format('%d %d %d %d', tonumber(redis.call('GET', k) or '0'), tonumber(redis.call('GET', p) or '0'),
      tonumber(mine), redis.call('HLEN', h))
  end)
  i = i + 1
  out[i] = ok and res or 'e'
end
return table.concat(out, ' ')
`

var (
	readScript    = redis.NewScript(readLua)
	writeScript   = redis.NewScript(writeLua)
	reserveScript = redis.NewScript(reserveLua)
)
