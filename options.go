package ratelimit

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"

	"github.com/edgelimit/caddy-ratelimit/origin"
)

// The global `ratelimit` option, line by line. Every line is one entry of
// a table (its name, its arguments and bounds, and where the value goes),
// parsed by one of a few parsers, one per kind of value, so that a
// duration, a count or a ratio is read and bounded the same way whatever
// backend it configures. Each backend declares its own lines beside its
// code (backendKind.lines); this file holds the app's.

func init() {
	httpcaddyfile.RegisterGlobalOption("ratelimit", parseGlobalOption)
}

// optionLine is one line of the global option.
type optionLine struct {
	name string
	// parse reads the line's arguments (the dispenser is on its name) into
	// the app; errors name the line.
	parse func(d *caddyfile.Dispenser, a *App) error
	// repeats is true of a line that may be given more than once (each
	// adds); any other line given twice is an error, not the last one
	// silently winning.
	repeats bool
}

// minDuration is the shortest duration any line takes: the engine counts
// in milliseconds.
const minDuration = origin.MinDuration

// appLines are the app's own lines.
var appLines = []optionLine{
	stringLine("region", validateRegion, func(a *App, v string) { a.Region = v }),
	stringLine("identifier_secret", validateSecret, func(a *App, v string) { a.IdentifierSecret = v }),
	flagLine("log_identifiers", func(a *App) { a.LogIdentifiers = true }),
	intLine("max_entries", 1, 0, func(a *App, n int) { a.MaxEntries = n }),
}

// optionLines returns every line of the global option: the app's and each
// backend kind's.
func optionLines() map[string]optionLine {
	lines := map[string]optionLine{}
	for _, l := range appLines {
		lines[l.name] = l
	}
	for _, k := range backendKinds {
		for _, l := range k.lines {
			lines[l.name] = l
		}
	}
	return lines
}

// parseGlobalOption parses the global `ratelimit` option into the
// `ratelimit` app. Given twice, the second block adds to the first.
func parseGlobalOption(d *caddyfile.Dispenser, existing any) (any, error) {
	app := new(App)
	if prev, ok := existing.(httpcaddyfile.App); ok && len(prev.Value) > 0 {
		if err := json.Unmarshal(prev.Value, app); err != nil {
			return nil, fmt.Errorf("ratelimit global option: %w", err)
		}
		// The earlier blocks' lines are gone with their tokens; what they
		// set is still in the JSON, and a line that sets it again is
		// given twice.
		var v any
		if err := json.Unmarshal(prev.Value, &v); err != nil {
			return nil, fmt.Errorf("ratelimit global option: %w", err)
		}
		app.setBefore = map[string]bool{}
		jsonLeaves(v, "", app.setBefore)
	}
	if err := app.UnmarshalCaddyfile(d); err != nil {
		return nil, err
	}
	return httpcaddyfile.App{Name: "ratelimit", Value: caddyconfig.JSON(app, nil)}, nil
}

// UnmarshalCaddyfile sets up the app from the global option's tokens.
// Syntax (the README has each line's meaning and default):
//
//	ratelimit {
//	    region            <name>
//	    identifier_secret <secret, e.g. {env.RATELIMIT_SECRET}>
//	    log_identifiers
//	    max_entries       <n>
//	    redis …           # the origin's lines (redis.go)
//	    mysql …           # the cross-region layer's lines (mysql.go)
//	}
func (a *App) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // option name
	if d.NextArg() {
		return d.ArgErr()
	}
	lines := optionLines()
	for d.NextBlock(0) {
		l, ok := lines[d.Val()]
		if !ok {
			return d.Errf("unknown subdirective %q of the ratelimit global option", d.Val())
		}
		if a.lineAt == nil {
			a.lineAt = map[string]string{}
		}
		if first, twice := a.lineAt[l.name]; twice && !l.repeats {
			return d.Errf("%s given twice (first at %s)", l.name, first)
		}
		if !l.repeats && a.setBefore != nil && setsAny(d, l, a.setBefore) {
			return d.Errf("%s given twice (first in an earlier ratelimit block)", l.name)
		}
		a.lineAt[l.name] = d.File() + ":" + strconv.Itoa(d.Line())
		if err := l.parse(d, a); err != nil {
			return err
		}
	}
	for _, k := range backendKinds {
		if err := k.checkLines(a, d); err != nil {
			return err
		}
	}
	return nil
}

// setsAny reports whether line l, on which d stands, sets a field of the
// app that set holds: l runs over a copy of its tokens into an empty app,
// whose JSON then holds only what the line sets (even when the line's own
// check fails: checked lines store before they check). d is left where it
// was.
func setsAny(d *caddyfile.Dispenser, l optionLine, set map[string]bool) bool {
	toks := []caddyfile.Token{d.Token()}
	for d.NextArg() {
		toks = append(toks, d.Token())
	}
	for range toks[1:] {
		d.Prev()
	}
	ld := caddyfile.NewDispenser(toks)
	ld.Next()
	fresh := new(App)
	_ = l.parse(ld, fresh) // the line's errors are the real parse's to report
	var v any
	if err := json.Unmarshal(caddyconfig.JSON(fresh, nil), &v); err != nil {
		return false
	}
	sets := map[string]bool{}
	jsonLeaves(v, "", sets)
	for path := range sets {
		if set[path] {
			return true
		}
	}
	return false
}

// jsonLeaves adds to out the path of every value in v that is not an
// object (a list is one value), as "a.b.c".
func jsonLeaves(v any, path string, out map[string]bool) {
	m, ok := v.(map[string]any)
	if !ok {
		out[path] = true
		return
	}
	for k, sub := range m {
		jsonLeaves(sub, path+"."+k, out)
	}
}

// oneArg returns the single argument of the current line. Given more, its
// error quotes none of them: Caddy's ArgErr quotes the next token, which
// for a Redis URL, a DSN or a secret split at a space is part of a password.
func oneArg(d *caddyfile.Dispenser) (string, error) {
	name := d.Val()
	if !d.NextArg() {
		return "", d.ArgErr()
	}
	v := d.Val()
	if extra := d.RemainingArgs(); len(extra) > 0 {
		return "", d.Errf("wrong argument count: %s takes one argument, got %d "+
			"(quote a value that holds spaces; the arguments are not repeated here, "+
			"as they may hold a password)", name, 1+len(extra))
	}
	if v == "" {
		return "", errEmptyArg(d, name)
	}
	return v, nil
}

// errEmptyArg reports an argument given empty. Taken as the line left out,
// a quoted "{$SECRET}" whose variable is not set would turn identifier_secret
// off without a word.
func errEmptyArg(d *caddyfile.Dispenser, name string) error {
	return d.Errf("%s: the value is empty (a {$VAR} whose environment variable is not set?): give a value, or leave the line out", name)
}

// The parsers, one per kind of value. Each takes where the value goes as a
// function of the app, so a backend's line fills the backend's settings;
// check, when a line has one, runs on the app after the value is stored,
// so an error that concerns several lines names the last.

// flagLine is a line without arguments.
func flagLine(name string, set func(*App)) optionLine {
	return optionLine{name: name, parse: func(d *caddyfile.Dispenser, a *App) error {
		if d.NextArg() {
			return d.ArgErr()
		}
		set(a)
		return nil
	}}
}

// stringLine is a line of one argument that check accepts.
func stringLine(name string, check func(string) error, set func(*App, string)) optionLine {
	return optionLine{name: name, parse: func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		if check != nil {
			if err := check(v); err != nil {
				return d.WrapErr(err)
			}
		}
		set(a, v)
		return nil
	}}
}

// intLine is a line of one integer from lo to hi (no upper bound when hi
// is 0).
func intLine(name string, lo, hi int, set func(*App, int)) optionLine {
	return optionLine{name: name, parse: func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		n, err := strconv.Atoi(v)
		switch {
		case hi > 0 && (err != nil || n < lo || n > hi):
			return d.Errf("%s: want an integer from %d to %d, got %q", name, lo, hi, v)
		case err != nil || n < lo:
			return d.Errf("%s: want an integer of at least %d, got %q", name, lo, v)
		}
		set(a, n)
		return nil
	}}
}

// durationLine is a line of one duration of at least lo (never below
// minDuration).
func durationLine(name string, lo time.Duration, set func(*App, time.Duration)) optionLine {
	return durationLineIn(name, lo, 0, set)
}

// durationLineIn is a durationLine of at most hi (0: no bound).
func durationLineIn(name string, lo, hi time.Duration, set func(*App, time.Duration)) optionLine {
	lo = max(lo, minDuration)
	return optionLine{name: name, parse: func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		dur, err := caddy.ParseDuration(v)
		switch {
		case err != nil || dur < lo:
			return d.Errf("%s: want a duration of at least %s, such as 1s, got %q", name, lo, v)
		case hi > 0 && dur > hi:
			return d.Errf("%s: want a duration of at most %s, got %q", name, hi, v)
		}
		set(a, dur)
		return nil
	}}
}

// ratioLine is a line of one ratio in (0, 1].
func ratioLine(name string, set func(*App, float64)) optionLine {
	return optionLine{name: name, parse: func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		r, err := strconv.ParseFloat(v, 64)
		if err != nil || !(r > 0 && r <= 1) {
			return d.Errf("%s: want a ratio in (0, 1], got %q", name, v)
		}
		set(a, r)
		return nil
	}}
}

// switchLine is a line of one `on` or `off`.
func switchLine(name string, set func(*App, bool)) optionLine {
	return optionLine{name: name, parse: func(d *caddyfile.Dispenser, a *App) error {
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		switch v {
		case "on":
			set(a, true)
		case "off":
			set(a, false)
		default:
			return d.Errf("%s: want on or off, got %q", name, v)
		}
		return nil
	}}
}

// argsLine is a line of at least n arguments, which set takes (and may
// refuse: its error names the line).
func argsLine(name string, n int, set func(a *App, args []string) error) optionLine {
	return optionLine{name: name, parse: func(d *caddyfile.Dispenser, a *App) error {
		args := d.RemainingArgs()
		if len(args) < n {
			return d.ArgErr()
		}
		if err := set(a, args); err != nil {
			return d.Errf("%v", err)
		}
		return nil
	}}
}

// repeating marks l as a line that may be given more than once.
func repeating(l optionLine) optionLine {
	l.repeats = true
	return l
}

// checked adds check to l: it runs on the app after the line's value is
// stored, and its error names the line.
func checked(l optionLine, check func(*App) error) optionLine {
	parse := l.parse
	l.parse = func(d *caddyfile.Dispenser, a *App) error {
		if err := parse(d, a); err != nil {
			return err
		}
		if err := check(a); err != nil {
			return d.Errf("%v", err)
		}
		return nil
	}
	return l
}

// Interface guards.
var _ caddyfile.Unmarshaler = (*App)(nil)
