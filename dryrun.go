package ratelimit

import (
	"sync/atomic"
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
// line; at info level a zone logs once per window, with the number since
// its previous line, so a dry run never logs per request at info.
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

// dryRunLog limits a dry-run zone's info line to one per window. There is
// one per zone name in the process's state (state.dryRunLog), shared by
// every handler of the zone in every loaded config: one of each handler
// logged the zone again after a reload, within the window, and dropped the
// count the old handler held.
type dryRunLog struct {
	// seq is the window sequence of the last line; count the would-be
	// denials since.
	seq, count atomic.Int64
}

// note counts a would-be denial and logs at info level on the first one of
// each window, with the number since the previous line. now is the
// engine's clock, whose windows the decisions count in.
func (d *dryRunLog) note(log *zap.Logger, zone string, window time.Duration, now time.Time) {
	d.count.Add(1)
	seq := now.UnixMilli() / window.Milliseconds()
	old := d.seq.Load()
	if old == seq || !d.seq.CompareAndSwap(old, seq) {
		return
	}
	log.Info("dry run: requests would have been rate limited",
		zap.String("zone", zone),
		zap.Int64("would_be_denied", d.count.Swap(0)),
		zap.Duration("window", window))
}
