package origin

import (
	"context"
	"errors"
	"regexp"
	"strings"

	"github.com/redis/go-redis/v9"
)

// A Redis that refuses scripts. Every call of the module is a Lua script
// (EVALSHA, or EVAL of its source): a server that refuses them (a
// redis.conf with rename-command EVALSHA "" and EVAL "", an ACL without
// them, a proxy that does not pass them) can serve none of its calls.
// Such a reply (ERR unknown command 'evalsha', a proxy's "unsupported
// command", NOPERM naming eval) says the server will not run the module's
// calls, whatever the keys: like READONLY or NOPERM it fails the whole
// call and counts against the breaker (countsAgainst), so requests decide
// locally rather than pay a round trip that always fails, and the error
// (Stats' LastError, the failing streak's log line) says so in words an
// operator can act on.

// ErrScriptsRefused: the server refuses Lua scripts. The error of a call
// it refused wraps it, with Redis's reply.
var ErrScriptsRefused = errors.New("redis refuses Lua scripts (EVAL/EVALSHA disabled or renamed, or not permitted); the rate limiter runs every call as a script and cannot use this server until they are allowed")

// scriptsRefusedError is a reply that refused a script, as ErrScriptsRefused.
type scriptsRefusedError struct {
	reply redis.Error
	said  string // the reply without the arguments Redis echoes
}

func (e *scriptsRefusedError) Error() string {
	return ErrScriptsRefused.Error() + ": Redis said " + e.said
}

func (e *scriptsRefusedError) Unwrap() []error { return []error{ErrScriptsRefused, e.reply} }

// scriptCommand matches a script command named in a reply: eval, evalsha
// and their read-only forms, as a word.
var scriptCommand = regexp.MustCompile(`(?i)(^|[^a-z0-9_|@])(evalsha_ro|evalsha|eval_ro|eval)([^a-z0-9_]|$)`)

// refusal phrases of a server or proxy that will not run a command.
var refusals = []string{"unknown command", "unsupported command", "not supported", "not allowed", "disabled", "no permissions to run"}

// explainScripts returns err as a scriptsRefusedError when it is Redis's
// refusal of a script command itself (not an error inside a script: a
// script that ran and failed names its script, and says nothing about
// the server), else err.
func explainScripts(err error) error {
	var rerr redis.Error
	if err == nil || errors.Is(err, ErrScriptsRefused) || !errors.As(err, &rerr) {
		return err
	}
	msg := rerr.Error()
	// Redis echoes the command's first arguments (keys, and with them
	// identifiers): never in a status or a log line.
	if i := strings.Index(msg, ", with args beginning with"); i >= 0 {
		msg = msg[:i]
	}
	lower := strings.ToLower(msg)
	if strings.Contains(lower, "script:") || strings.Contains(lower, "user_script") || !scriptCommand.MatchString(msg) {
		return err
	}
	for _, p := range refusals {
		if strings.Contains(lower, p) {
			return &scriptsRefusedError{reply: rerr, said: strings.TrimSpace(msg)}
		}
	}
	return err
}

// probeScripts runs the smallest script on c and returns ErrScriptsRefused
// (with the reply) when the server refuses scripts, else nil: other
// errors (a server down) are the other checks' business.
func probeScripts(ctx context.Context, c redis.Cmdable) error {
	if err := explainScripts(c.Eval(ctx, "return 1", nil).Err()); errors.Is(err, ErrScriptsRefused) {
		return err
	}
	return nil
}
