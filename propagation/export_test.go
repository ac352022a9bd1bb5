package propagation

import "go.uber.org/zap"

// OpenStore opens the MySQL store of cfg (after its defaults) for the
// package's external tests, which import the simulator's model of MySQL
// (internal/simmodel imports this package).
func OpenStore(cfg Config) (interface {
	Store
	ClockStore
}, error) {
	st, _, err := openStore(cfg.WithDefaults(), zap.NewNop())
	if err != nil {
		return nil, err
	}
	return st, nil
}
