package origin

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Resets of a key: an operator makes a key start over from zero in its
// current window on every node of the region (a region reset) or of every
// region (a global one). With idempotent per-incarnation totals, deleting
// the cell would be no reset (every node writes its total back on its next
// replay), so a reset marks the cell instead: r holds what t was at the
// reset, and every script says t − r (scripts.go). The units written after
// the reset count as usual, those from before never come back. The
// previous cell is marked too, so the key's previous window weighs nothing.
//
// What the cell imported from other regions (g) starts over too, and how
// depends on the reset. A region reset marks rg := g: the cell says g − rg.
// A global reset is marked in every region, each when it hears of it,
// under one version (the reset's): the cell keeps the version (gv) and its
// own total then (gb), which the cross-region role publishes with the
// region's count, so that every other region takes exactly the units
// counted after this region's mark off its count (count − gb). A cell
// some region reset (and only such a cell: the holder imports any other as
// one sum, role.go) keeps each foreign region's import as a field of its
// own,
//
//	x.<region>   "<count> <denied> <version> <base> <snapshot>": the
//	             largest published count, the largest count a denial row
//	             gave (both as the region counted them), the newest global
//	             reset the region published for the cell with its base
//	             then, and what the import was when this region last
//	             marked a global reset
//
// and g is the sum of their shares (kept as gx, which every import moves
// by what the parts it carries moved). A region that marks resets
// publishes version 1 until it marked one (a region with Redis: every one
// of this build); one that cannot (a process without Redis, or an older
// build) publishes 0.
// Each region's share is
//
//   - the larger of count and denied while this cell was never reset here;
//   - its count − its base, once it published the cell's newest reset (or
//     a newer one): exactly the units it counted since it marked;
//   - nothing while a region that marks resets has not published this
//     one: what it admitted before its mark (before the reset, or after
//     it but before it heard) starts over when it marks, and its rows do
//     not say which of their units came after, so it counts from its mark
//     only; g never falls when the mark arrives, so no node's view (which
//     only rises) keeps units that are gone;
//   - count − snapshot for a region that cannot mark: what it published
//     since this region marked, units it admitted before the reset and
//     had not published yet included.
//
// Which keys were reset reaches the region's nodes as an override record
// (the root's, opaque here: overrides.go), so that each drops its own
// state of the key.

// importsLua defines importOf(v), an import field's value as numbers (nil
// for anything else: a process's record, "<node ID>.<incarnation>" with a
// hex node ID, holds one number), imports(h), the cell h's per-region
// imports by field, what a global reset reads whole,
// and share(p, gv), what one of them adds to g in a cell whose newest
// global reset is gv (0: never reset); maxCount is engine.MaxCount, where
// an imported count saturates. Versions are Unix microseconds, exact as
// Lua numbers.
const importsLua = `
local maxCount = 9007199254740991
local function importOf(val)
  local c, d, v, b, s = string.match(val, '^(%d+) (%d+) (%d+) (%d+) (%d+)$')
  if c then return {tonumber(c), tonumber(d), tonumber(v), tonumber(b), tonumber(s)} end
end
local function imports(h)
  local all, out = redis.call('HGETALL', h), {}
  for i = 1, #all, 2 do
    local p = string.sub(all[i], 1, 2) == 'x.' and importOf(all[i+1])
    if p then out[all[i]] = p end
  end
  return out
end
local function share(p, gv)
  if p[3] > 1 and p[3] >= gv then return math.max(p[1] - p[4], 0) end
  if gv == 0 then return math.max(p[1], p[2]) end
  if p[3] > 0 then return 0 end
  return math.max(math.max(p[1], p[2]) - p[5], 0)
end
local function importField(p)
  return string.format('%d %d %d %d %d', p[1], p[2], p[3], p[4], p[5])
end
`

// resetScript marks each cell KEYS[i]. ARGV[1] is the global reset's
// version, 0 for a region reset: r := t and rg := g in a cell that
// exists; a global reset the cell holds already (or one older than it
// holds) changes nothing, a newer one sets r, gb := t and gv, snapshots
// every import and sums g again (rg := 0: the snapshots take the old part
// off). A global reset makes a cell the region does not hold yet, marked,
// with the expiry ARGV[i+1]: another region's units from before its mark
// that arrive later then count as they would in a cell that existed.
var resetScript = redis.NewScript(importsLua + `
local ver = tonumber(ARGV[1])
for i = 1, #KEYS do
  local h = KEYS[i]
  local v = redis.call('HMGET', h, 't', 'g', 'gv')
  if not v[1] and ver > 0 then
    redis.call('HSET', h, 't', '0', 'n', '0', 'r', '0', 'g', '0', 'gx', '0', 'rg', '0', 'gb', '0', 'gv', ARGV[1])
    redis.call('PEXPIREAT', h, ARGV[i+1])
  elseif v[1] then
    if ver == 0 then
      redis.call('HSET', h, 'r', v[1], 'rg', v[2] or '0')
    elseif ver > tonumber(v[3] or '0') then
      local g = 0
      for f, p in pairs(imports(h)) do
        p[5] = math.max(p[1], p[2])
        redis.call('HSET', h, f, importField(p))
        g = g + share(p, ver)
      end
      redis.call('HSET', h, 'r', v[1], 'gb', v[1], 'gv', ARGV[1], 'rg', '0', 'gx', string.format('%d', g),
        'g', string.format('%d', math.min(g, maxCount)))
    end
  end
end
return 0
`)

// ResetCells marks the key's cell seq and the one before it as reset:
// version is the global reset's (its override's version), 0 for a reset
// of the region alone.
func (r *Redis) ResetCells(ctx context.Context, key engine.Key, seq, version int64) error {
	ep := r.route(key)
	cur, prev := cellKeys(r.prefix, key, seq)
	if err := resetScript.Run(ctx, ep.client, []string{cur, prev}, strconv.FormatInt(max(version, 0), 10),
		expireAt(key, seq).UnixMilli(), expireAt(key, seq-1).UnixMilli()).Err(); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("redis reset %s (zone %q): %w", ep.address, key.Namespace, explainScripts(err))
	}
	return nil
}
