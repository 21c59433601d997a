// Command sloglint is go-simpler.org/sloglint's single checker with the log
// schema of docs/agent.md ("Logging") built in: each part logs through its
// own *slog.Logger, messages are fixed text with what varies in keys,
// key-value pairs only, snake_case keys, and only the keys of
// hack/sloglint/logkeys. `make verify` runs it over the shipped packages.
package main

import (
	"go-simpler.org/sloglint"
	"golang.org/x/tools/go/analysis/singlechecker"

	"github.com/ambientd/ambientd/hack/sloglint/logkeys"
)

func main() {
	singlechecker.Main(sloglint.New(&sloglint.Options{
		NoGlobalLogger:    "all",
		StaticMessage:     true,
		NoMixedArguments:  true,
		KeyValuePairsOnly: true,
		KeyNamingCase:     "snake",
		AllowedKeys:       logkeys.Allowed,
		ForbiddenKeys:     logkeys.Forbidden,
	}))
}
