package origin

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// Connection tunables. Every call also carries its own deadline (the
// engine's read timeout, or the replay deadline), which go-redis honours
// because ContextTimeoutEnabled is set; these are backstops.
const (
	// maxCallTimeout bounds a call whose context has no earlier deadline, and
	// is the socket timeout unless read_timeout is longer (callTimeout):
	// never wait a full client default (5 s) for a rate limit counter.
	maxCallTimeout = time.Second
	// dialTimeout bounds one connection attempt. Dials happen on a replay
	// worker or a read batcher, never on a request's goroutine, so it may
	// be longer than a read timeout; shorter than maxCallTimeout so a dead
	// host is noticed within one call.
	dialTimeout = 500 * time.Millisecond
	// dialAttempts is one: a refused dial fails the call at once and counts
	// against the breaker, instead of go-redis retrying five times inside
	// one call's budget.
	dialAttempts = 1
	// noRetries disables go-redis's command retries (-1 means none). A
	// retried INCRBY whose first attempt reached Redis but lost its reply
	// would count twice; the engine replays whatever was not reported Done,
	// and the breaker sees every failure. A Cluster client retries
	// regardless (up to maxRedirects), so the reservation, which is not
	// idempotent, goes as a command that says so (reserve.go, runOnce).
	noRetries = -1
	// poolSize is the connections per server: enough for every replay
	// worker and read batcher at once (maxReadRoundTrips + the default 8
	// workers) with room to spare, so a pipeline never waits for a
	// connection on a healthy Redis.
	poolSize = 32
	// maxRedirects bounds MOVED/ASK hops in a Cluster during resharding.
	maxRedirects = 3
)

// newClient builds the go-redis client of one endpoint, whose socket
// timeout is timeout (see callTimeout). It does not dial: go-redis
// connects on the first command, so a Caddy `validate` that provisions and
// cleans up never touches the network.
func newClient(s endpointSpec, roots *x509.CertPool, timeout time.Duration) redis.UniversalClient {
	var tlsConfig *tls.Config
	if s.tls {
		// ServerName is left empty: the TLS dialer takes it from the
		// address dialled, which is right for every node of a Cluster too.
		tlsConfig = &tls.Config{
			MinVersion:         tls.VersionTLS12,
			RootCAs:            roots,
			InsecureSkipVerify: s.tlsSkipVer, //nolint:gosec // the operator's explicit skip_verify=true
		}
	}
	// One set of options for every kind; Cluster, Failover and Simple copy
	// what their kind knows of it (a Cluster has no database, a client of
	// Sentinels no maintenance notifications, a standalone client uses the
	// first address).
	o := &redis.UniversalOptions{
		Addrs:                 s.addrs,
		MasterName:            s.master,
		SentinelUsername:      s.sentinelUser,
		SentinelPassword:      s.sentinelPass,
		Username:              s.username,
		Password:              s.password,
		DB:                    s.db,
		Dialer:                dialer(tlsConfig),
		TLSConfig:             tlsConfig,
		MaxRetries:            noRetries,
		MaxRedirects:          maxRedirects,
		DialTimeout:           dialTimeout,
		DialerRetries:         dialAttempts,
		ReadTimeout:           timeout,
		WriteTimeout:          timeout,
		ContextTimeoutEnabled: true,
		PoolSize:              poolSize,
		PoolTimeout:           maxCallTimeout,
		DisableIdentity:       true,
		// Maintenance notifications (a Redis Enterprise feature) would send
		// an extra command on every connection and expect RESP3 push
		// messages.
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
	}
	switch s.kind {
	case KindCluster:
		return redis.NewClusterClient(o.Cluster())
	case KindSentinel:
		return redis.NewFailoverClient(o.Failover())
	}
	return redis.NewClient(o.Simple())
}

// callTimeout is the longest a call may take: maxCallTimeout, or the
// request path's read timeout when it is longer. go-redis cuts a call at
// the earlier of its context's deadline and the socket timeout, so a
// socket timeout of maxCallTimeout cut every read and reservation at a
// second whatever read_timeout said (up to 10 s), and a Redis answering
// in 1.5 s failed each one of them
// (TestRead_AReadTimeoutAboveASecondIsWaitedFor).
func callTimeout(readTimeout time.Duration) time.Duration {
	return max(maxCallTimeout, readTimeout)
}

// certPool reads the PEM file of certificate authorities named by
// tls_ca_file; nil (the system's roots) when file is "".
func certPool(file string) (*x509.CertPool, error) {
	if file == "" {
		return nil, nil
	}
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("tls_ca_file: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("tls_ca_file %s: no PEM certificate in it", file)
	}
	return roots, nil
}

// dialer returns a dial function that honours the context's deadline for
// TLS too (go-redis's default TLS dialer only knows DialTimeout).
func dialer(tlsConfig *tls.Config) func(ctx context.Context, network, addr string) (net.Conn, error) {
	nd := &net.Dialer{Timeout: dialTimeout, KeepAlive: 30 * time.Second}
	if tlsConfig == nil {
		return nd.DialContext
	}
	td := &tls.Dialer{NetDialer: nd, Config: tlsConfig}
	return td.DialContext
}

// SetLogger routes the Redis client library's own log lines (failed dials,
// pool events) to printf; by default they go to stderr. That logger is
// global to the process, so the last call wins. Its lines name addresses,
// never passwords.
func SetLogger(printf func(format string, args ...any)) { redis.SetLogger(logFunc(printf)) }

type logFunc func(format string, args ...any)

func (f logFunc) Printf(_ context.Context, format string, args ...any) { f(format, args...) }
