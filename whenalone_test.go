package ratelimit

import (
	"testing"
	"testing/synctest"
)

// TestState_WhenAloneWaitsForAnAppAboutToStart: an app's backends start
// before the state records the app as started (App.Start), and the
// restart watch's first check runs at once, so whenAlone can be asked
// for an app that is provisioned and not started yet. It waits for the
// start and runs f then; before, it took the app for one already
// stopped and dropped f: a restart found by that first check was never
// answered with the counts.
func TestState_WhenAloneWaitsForAnAppAboutToStart(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s, a := &state{}, &App{}
		s.apps.mu.Lock()
		s.apps.provisioned = []*App{a}
		s.apps.mu.Unlock()
		ran := false
		s.whenAlone(a, func() { ran = true })
		synctest.Wait() // whenAlone has looked, before the start
		s.apps.mu.Lock()
		s.apps.started = append(s.apps.started, a)
		s.apps.startedChanged()
		s.apps.mu.Unlock()
		synctest.Wait()
		if !ran {
			t.Fatal("f did not run once the app started alone")
		}
	})
}

// TestState_WhenAloneEndsForAnAppCleanedUpUnstarted: an app that is
// cleaned up without starting (another app of its config failed first)
// runs no f, and its waiter ends: synctest.Test fails on a goroutine
// still blocked when the test returns.
func TestState_WhenAloneEndsForAnAppCleanedUpUnstarted(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s, running, failed := &state{}, &App{}, &App{}
		s.apps.mu.Lock()
		s.apps.provisioned = []*App{running, failed}
		s.apps.started = []*App{running}
		s.apps.mu.Unlock()
		ran := false
		s.whenAlone(failed, func() { ran = true })
		synctest.Wait()
		s.apps.mu.Lock()
		s.apps.provisioned = s.apps.provisioned[:1]
		s.apps.startedChanged() // as liveApps.cleanup does
		s.apps.mu.Unlock()
		synctest.Wait()
		if ran {
			t.Fatal("f ran for an app that never started")
		}
	})
}
