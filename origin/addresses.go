package origin

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
)

// Endpoint kinds, as shown in Stats.
const (
	KindStandalone = "standalone"
	KindCluster    = "cluster"
	KindSentinel   = "sentinel"
)

// endpointSpec is one endpoint resolved from the configuration, before any
// client exists.
type endpointSpec struct {
	kind string
	// address is the endpoint's name for operators: scheme, hosts, port
	// and database, never credentials. A Cluster or a Sentinel group is
	// placed by it, a partition by its partitionLabel (placementLabel).
	address string

	addrs      []string // host:port
	username   string
	password   string
	db         int
	tls        bool
	tlsSkipVer bool

	master                     string
	sentinelUser, sentinelPass string
}

// endpoints resolves the configured backend into endpoint specs.
func (c Config) endpoints() ([]endpointSpec, error) {
	set := 0
	for _, on := range []bool{len(c.Redis) > 0, c.Cluster != nil, c.Sentinel != nil} {
		if on {
			set++
		}
	}
	switch {
	case set == 0:
		return nil, errors.New("redis: no Redis configured (set redis, redis_cluster or redis_sentinel)")
	case set > 1:
		return nil, errors.New("redis: set only one of redis, redis_cluster and redis_sentinel")
	case c.Cluster != nil:
		return one(clusterSpec(c.Cluster))
	case c.Sentinel != nil:
		return one(sentinelSpec(c.Sentinel))
	}
	return partitionSpecs(c.Redis)
}

// one is the single spec of a Cluster or a Sentinel group as a list.
func one(s endpointSpec, err error) ([]endpointSpec, error) {
	if err != nil {
		return nil, err
	}
	return []endpointSpec{s}, nil
}

func clusterSpec(c *ClusterConfig) (endpointSpec, error) {
	s, err := parseGroup("redis_cluster", c.Addrs)
	if err != nil {
		return s, err
	}
	if s.db != 0 {
		return s, errors.New("redis_cluster: a cluster has no databases but database 0")
	}
	s.kind = KindCluster
	s.address = groupAddress(s, "")
	return s, nil
}

func sentinelSpec(c *SentinelConfig) (endpointSpec, error) {
	if c.Master == "" {
		return endpointSpec{}, errors.New("redis_sentinel: the master name is missing")
	}
	s, err := parseGroup("redis_sentinel", c.Addrs)
	if err != nil {
		return s, err
	}
	s.kind = KindSentinel
	s.master = c.Master
	s.sentinelUser = c.SentinelUsername
	s.sentinelPass = c.SentinelPassword
	s.address = groupAddress(s, c.Master)
	return s, nil
}

// partitionSpecs resolves the standalone servers, one partition each; two
// URLs of one server and database are one partition named twice.
func partitionSpecs(urls []string) ([]endpointSpec, error) {
	specs := make([]endpointSpec, 0, len(urls))
	seen := make(map[string]int, len(urls))
	for i, raw := range urls {
		s, err := parseRedisURL(raw)
		if err != nil {
			return nil, fmt.Errorf("redis #%d: %w", i+1, err)
		}
		s.kind = KindStandalone
		s.address = fmt.Sprintf("%s://%s/%d", scheme(s.tls), s.addrs[0], s.db)
		if j, dup := seen[s.partitionLabel()]; dup {
			return nil, fmt.Errorf("redis #%d: %s is already partition #%d", i+1, s.address, j+1)
		}
		seen[s.partitionLabel()] = i
		specs = append(specs, s)
	}
	return specs, nil
}

// partitionLabel is what rendezvous hashing places keys by: the server and
// database, which every process of a region names alike, and not the scheme
// or credentials, which may differ per process.
func (s *endpointSpec) partitionLabel() string {
	return s.addrs[0] + "/" + strconv.Itoa(s.db)
}

// placementLabel is what route.go hashes an endpoint by: a partition's
// label, or the address of a Cluster or a Sentinel group (alone in their
// configuration, so never placed against another endpoint).
func (s *endpointSpec) placementLabel() string {
	if s.kind == KindStandalone {
		return s.partitionLabel()
	}
	return s.address
}

func scheme(tls bool) string {
	if tls {
		return "rediss"
	}
	return "redis"
}

func groupAddress(s endpointSpec, master string) string {
	var b strings.Builder
	b.WriteString(scheme(s.tls))
	if s.kind == KindSentinel {
		b.WriteString("+sentinel://")
		b.WriteString(master)
		b.WriteByte('@')
	} else {
		b.WriteString("+cluster://")
	}
	b.WriteString(strings.Join(s.addrs, ","))
	if s.kind == KindSentinel {
		fmt.Fprintf(&b, "/%d", s.db)
	}
	return b.String()
}

// parseRedisURL parses one redis:// or rediss:// URL. Its errors never
// quote the URL: a malformed one may have its password anywhere.
func parseRedisURL(raw string) (endpointSpec, error) {
	var s endpointSpec
	if !strings.Contains(raw, "://") {
		return s, errors.New("missing scheme: use redis://host:port or rediss://host:port")
	}
	u, err := url.Parse(raw)
	if err != nil {
		// url.Error quotes the whole URL, and its inner error may quote the
		// part of a password that broke the syntax: say neither.
		return s, errors.New("not a valid URL (percent-encode special characters in the password)")
	}
	switch u.Scheme {
	case "redis":
	case "rediss":
		s.tls = true
	default:
		return s, fmt.Errorf("unsupported scheme %q: use redis:// or rediss://", u.Scheme)
	}
	if u.Opaque != "" {
		return s, errors.New("not a valid URL: use redis://host:port")
	}
	host, port := u.Hostname(), u.Port()
	if host == "" {
		return s, errors.New("missing host")
	}
	if port == "" {
		port = "6379"
	}
	addr, err := canonicalAddr(host, port)
	if err != nil {
		return s, err
	}
	s.addrs = []string{addr}
	if u.User != nil {
		s.username = u.User.Username()
		s.password, _ = u.User.Password()
	}
	if s.db, err = parseDB(u.Path); err != nil {
		return s, err
	}
	return s, parseURLParameters(&s, u.Query())
}

// parseDB reads the database number of a URL's path ("" and "/" are 0).
func parseDB(path string) (int, error) {
	switch p := strings.Trim(path, "/"); {
	case p == "":
		return 0, nil
	case strings.Contains(p, "/"):
		return 0, errors.New("invalid path: only a database number may follow the host")
	default:
		db, err := strconv.Atoi(p)
		if err != nil || db < 0 {
			// Not quoted: in a URL whose password broke the syntax, the
			// path may hold the rest of the password.
			return 0, errors.New("invalid database number in the path")
		}
		return db, nil
	}
}

// parseURLParameters applies a URL's query to s: skip_verify, and nothing
// else.
func parseURLParameters(s *endpointSpec, query url.Values) error {
	for k, vs := range query {
		switch k {
		case "skip_verify":
			if !s.tls {
				return errors.New("skip_verify applies to rediss:// only")
			}
			v := vs[len(vs)-1]
			b, err := strconv.ParseBool(v)
			if err != nil {
				return errors.New("skip_verify: not a boolean")
			}
			s.tlsSkipVer = b
		default:
			// Connection tuning is this package's job (timeouts, retries and
			// pools are chosen for the request path); a silently ignored
			// parameter would surprise more than an error.
			return fmt.Errorf("unsupported URL parameter %q (only skip_verify is accepted)", k)
		}
	}
	return nil
}

// parseGroup parses the addresses of a Cluster or of Sentinels: bare
// host:port seeds and URLs, whose credentials and TLS must agree.
func parseGroup(field string, addrs []string) (endpointSpec, error) {
	var s endpointSpec
	if len(addrs) == 0 {
		return s, fmt.Errorf("%s: at least one address is required", field)
	}
	var first *endpointSpec
	seen := make(map[string]bool, len(addrs))
	for i, a := range addrs {
		var addr string
		if strings.Contains(a, "://") {
			u, err := parseRedisURL(a)
			if err != nil {
				return s, fmt.Errorf("%s address #%d: %w", field, i+1, err)
			}
			if first == nil {
				first = &u
			} else if u.username != first.username || u.password != first.password ||
				u.tls != first.tls || u.tlsSkipVer != first.tlsSkipVer || u.db != first.db {
				return s, fmt.Errorf("%s address #%d: credentials, scheme, database or skip_verify differ from an earlier URL; all must agree", field, i+1)
			}
			addr = u.addrs[0]
		} else {
			host, port, err := net.SplitHostPort(a)
			if err != nil || host == "" {
				// Not quoted: "user:password@host:port" without a scheme lands here.
				return s, fmt.Errorf("%s address #%d: not host:port or a redis:// URL", field, i+1)
			}
			if addr, err = canonicalAddr(host, port); err != nil {
				return s, fmt.Errorf("%s address #%d: %w", field, i+1, err)
			}
		}
		if seen[addr] {
			return s, fmt.Errorf("%s address #%d: %s is listed twice", field, i+1, addr)
		}
		seen[addr] = true
		s.addrs = append(s.addrs, addr)
	}
	if first != nil {
		s.username, s.password = first.username, first.password
		s.tls, s.tlsSkipVer, s.db = first.tls, first.tlsSkipVer, first.db
	}
	return s, nil
}

// canonicalAddr spells host:port one way for every way of naming the same
// server, so that partitions are placed (and duplicates found) by server,
// not by spelling: the port in decimal without leading zeros, an IP address
// in its canonical form (IPv6 compressed, an IPv4-mapped one as IPv4), a
// host name in lower case without a trailing dot.
func canonicalAddr(host, port string) (string, error) {
	n, err := strconv.Atoi(port)
	if err != nil || n < 1 || n > 65535 {
		return "", errors.New("invalid port")
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		host = ip.Unmap().String()
	} else {
		host = strings.TrimSuffix(strings.ToLower(host), ".")
	}
	return net.JoinHostPort(host, strconv.Itoa(n)), nil
}
