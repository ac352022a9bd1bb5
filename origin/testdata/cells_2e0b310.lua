-- cellsLua as released at 2e0b310 (raiseLua + cellsLua of origin/scripts.go),
-- kept unchanged for TestFlush_OldAndNewScriptsShareACell: processes of
-- the build before and after a change of the script share one Redis
-- during a rolling deploy.
local max = 9007199254740991
local fmt = string.format
local function num(v) return tonumber(v or '0') end
local function raise(h, f, own, at)
  local v = redis.call('HMGET', h, f, 't', 'g', 'n', 'r', 'rg')
  local mine, t, n = num(v[1]), num(v[2]), num(v[4])
  local ms, ts, made = v[1] or '0', v[2] or '0', not v[2]
  local o = tonumber(own)
  if o > mine or not v[1] then
    local add = math.max(o - mine, 0)
    if add > max - t then add = max - t end
    if add > 0 then
      t = t + add
      if t == o then ts = own else ts = fmt('%d', t) end
      made = true
    end
    if o > mine then mine, ms = o, own end
    if v[1] then
      redis.call('HSET', h, f, ms, 't', ts)
    else
      n = n + 1
      redis.call('HSET', h, f, ms, 't', ts, 'n', fmt('%d', n))
    end
    if not v[2] then redis.call('PEXPIREAT', h, at) end
  end
  return t, mine, n, num(v[3]), num(v[5]), num(v[6]), ts, ms, made
end
local function prev(p)
  local v = redis.call('HMGET', p, 't', 'g', 'r', 'rg')
  return math.max(num(v[1]) - num(v[3]), 0), math.max(num(v[2]) - num(v[4]), 0)
end

local find = string.find
local function text(v, mark)
  if mark then return fmt('%d', math.max(num(v) - num(mark), 0)) end
  if not v then return '0' end
  if find(v, '^%d+$') and #v < 16 then return v end
  return fmt('%d', math.min(math.max(tonumber(v), 0), max))
end
local function cell(h, p, f, own, at, wp)
  local t, mine, n, g, r, rg, ts, ms, made = raise(h, f, own, at)
  if r > 0 then ts = fmt('%d', math.max(t - r, 0)) elseif not made then ts = text(ts) end
  if ms ~= own then ms = text(ms) end
  local gs, pt, pg = '0', '0', '0'
  if g > 0 then gs = fmt('%d', math.max(g - rg, 0)) end
  if wp == '1' then
    local v = redis.call('HMGET', p, 't', 'g', 'r', 'rg')
    pt, pg = text(v[1], v[3]), text(v[2], v[4])
  end
  return ts .. ' ' .. pt .. ' ' .. ms .. ' ' .. fmt('%d', n) .. ' ' .. gs .. ' ' .. pg
end
local node, out, i, k = ARGV[1] .. '.', {}, 0, 1
for inc, own, at, wp in string.gmatch(ARGV[2], '(%d+) (%d+) (%d+) (%d)') do
  local h, p = KEYS[k], nil
  if wp == '1' then p, k = KEYS[k+1], k + 2 else k = k + 1 end
  local ok, res = pcall(cell, h, p, node .. inc, own, at, wp)
  i = i + 1
  out[i] = ok and res or 'e'
end
return table.concat(out, ' ')
