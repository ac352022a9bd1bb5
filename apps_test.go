package ratelimit

import (
	"testing"

	"go.uber.org/zap/zapcore"
)

func TestLiveApps_NewestProvisionedSpeaksAfterFailedReload(t *testing.T) {
	var o liveApps
	if v := o.view(); v.app != nil || v.logger == nil {
		t.Fatalf("no app: %+v, want the default logger", v)
	}
	running, _ := observedApp(zapcore.InfoLevel, identities{})
	failed, _ := observedApp(zapcore.InfoLevel, identities{secret: []byte("0123456789abcdef")})
	next, _ := observedApp(zapcore.InfoLevel, identities{})
	o.provision(running)
	o.provision(failed) // a reload provisions its app first...
	if o.view().app != failed || !o.view().ids.hashed() {
		t.Fatal("the newest app must speak for the process")
	}
	o.cleanup(failed) // ...and cleans it up when it fails
	if o.view().app != running {
		t.Fatal("after a failed reload the running config's app must speak again")
	}
	o.provision(next)
	o.cleanup(running) // a successful reload cleans up the old app last
	if o.view().app != next {
		t.Fatal("after a reload the new app must speak")
	}
	o.cleanup(next)
	if o.view().app != nil {
		t.Fatal("no app left")
	}
}
