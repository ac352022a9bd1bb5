package ratelimit

import (
	"sync"
	"time"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Dry run: a dry_run handler never denies. The engine charges every
// request and marks the decisions that would have denied; ServeHTTP serves
// the request and hands those decisions here, to be logged.

// dryRunDenied logs a would-be denial (countDecisions has counted it); the
// engine has already charged the request. Each would-be denial is a debug
// line; at info level a zone logs once per window, with the window's
// number once it ended (dryRunLog), so a dry run never logs per request
// at info.
func (h *Handler) dryRunDenied(lims []engine.Limit, decs []engine.Decision, zi []int) {
	for k := range decs {
		if decs[k].Allowed {
			continue
		}
		z := &h.zones[zi[k]]
		if c := h.logger.Check(zapcore.DebugLevel, "dry run: request would have been rate limited"); c != nil {
			// The identifier as the app's settings show it (normalized as
			// the engine keeps it, so an HMAC matches the admin API's);
			// never the URI, which may carry it.
			id := engine.NormalizeIdentifier(lims[k].Identifier)
			c.Write(append(h.ids.logFields(id), zap.String("zone", z.name))...)
		}
		z.dryRun.note(h.logger, z.name, z.window, h.engine.Now())
	}
}

// dryRunMissing logs a request that an enforcing handler would have
// denied for zone i's missing key (on_missing_key deny), as dryRunDenied
// logs the others; limits has counted it.
func (h *Handler) dryRunMissing(i int) {
	z := &h.zones[i]
	if c := h.logger.Check(zapcore.DebugLevel, "dry run: request would have been rate limited"); c != nil {
		c.Write(zap.String("zone", z.name), zap.Bool("missing_key", true))
	}
	z.dryRun.note(h.logger, z.name, z.window, h.engine.Now())
}

// dryRunLog gives a dry-run zone's info line: one per window, with the
// window's number of would-be denials, logged once the window ended (at
// the zone's first would-be denial of a later window, or at the window's
// end by a timer, so an idle zone's last window is reported too). There
// is one per zone name in the process's state (state.dryRunLog), shared
// by every handler of the zone in every loaded config: one of each
// handler logged the zone again after a reload, within the window, and
// dropped the count the old handler held.
//
// Until 2026-11-29 the line came at the first would-be denial of each
// window, with the number since the previous line: each line reported the
// previous window's rest and its own first one (a window of 2 would-be
// denials and a missing key logged 1, the next window's line 2 + 1), and
// a window's rest went unreported until a later window had a denial
// (TestHandler_DryRunLogsEachWindowsOwnNumber).
type dryRunLog struct {
	mu sync.Mutex
	// seq and window are the window counting now; count its would-be
	// denials not yet logged.
	seq    int64
	window time.Duration
	count  int64
	// log and zone are the newest handler's, for the timer's line.
	log  *zap.Logger
	zone string
	// timer logs the window at its end; gen numbers the timers, so that
	// one stopped too late logs nothing.
	timer *time.Timer
	gen   uint64
}

// note counts a would-be denial in the window now is in, and logs the
// window counted before, if any, with its number. now is the engine's
// clock, whose windows the decisions count in; the timer that logs a
// window at its end runs on the process's (a clock offset moves it by
// as much, and a denial counted after it fired is logged at the next).
func (d *dryRunLog) note(log *zap.Logger, zone string, window time.Duration, now time.Time) {
	seq := now.UnixMilli() / window.Milliseconds()
	d.mu.Lock()
	defer d.mu.Unlock()
	d.log, d.zone = log, zone
	if seq != d.seq || window != d.window {
		d.flushLocked()
		d.seq, d.window = seq, window
	}
	d.count++
	if d.timer == nil {
		end := time.UnixMilli((seq + 1) * window.Milliseconds())
		gen := d.gen
		d.timer = time.AfterFunc(max(end.Sub(now), 0), func() { d.ended(gen) })
	}
}

// ended is the timer's: the window it was armed for ended.
func (d *dryRunLog) ended(gen uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.gen == gen {
		d.flushLocked()
	}
}

// close logs what the window counting now has counted (the engine is
// closing) and stops its timer.
func (d *dryRunLog) close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.flushLocked()
}

// flushLocked logs the window counted, if it counted anything since its
// last line, and stops its timer.
func (d *dryRunLog) flushLocked() {
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
	d.gen++
	if d.count == 0 {
		return
	}
	d.log.Info("dry run: requests would have been rate limited",
		zap.String("zone", d.zone),
		zap.Int64("would_be_denied", d.count),
		zap.Duration("window", d.window),
		zap.Time("window_start", time.UnixMilli(d.seq*d.window.Milliseconds())))
	d.count = 0
}
