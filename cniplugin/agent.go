package cniplugin

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"sync/atomic"
	"syscall"

	"github.com/containernetworking/cni/pkg/types"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/ambientd/ambientd/cniapi"
)

// The gRPC codes agentError distinguishes, named for readability.
const (
	codeDeadlineExceeded = codes.DeadlineExceeded
	codeUnavailable      = codes.Unavailable
	codePermissionDenied = codes.PermissionDenied
)

// errNoAgent marks a call that failed because no process listens on the
// agent's socket: the socket file is missing, or connecting to it is
// refused. Only this failure lets the plugin consult the install lease;
// timeouts and the agent's own errors never do.
var errNoAgent = errors.New("no agent listening")

// callAgent makes one call on a fresh connection to the agent's socket. The
// call fails fast (no wait-for-ready) when nothing listens there: the runtime
// retries the sandbox, which is better than holding it for the whole timeout.
// When nobody listens, the error also matches errNoAgent.
func callAgent(ctx context.Context, socket string, call func(cniapi.CNIEventsClient) error) error {
	// Say plainly that the agent is not there instead of gRPC's dial error.
	if fi, err := os.Stat(socket); err != nil {
		st := status.Newf(codes.Unavailable, "agent socket: %v (is the ambientd agent running on this node?)", err)
		if errors.Is(err, fs.ErrNotExist) {
			return noAgent{st.Err()}
		}
		return st.Err()
	} else if fi.Mode()&os.ModeSocket == 0 {
		return status.Errorf(codes.Unavailable, "agent socket %s is not a socket", socket)
	}
	var refused atomic.Bool
	dial := func(ctx context.Context, _ string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", socket)
		if errors.Is(err, syscall.ECONNREFUSED) {
			refused.Store(true)
		}
		return c, err
	}
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithContextDialer(dial))
	if err != nil {
		return types.NewError(types.ErrInvalidNetworkConfig, "ambientd-cni: invalid agentSocket", err.Error())
	}
	defer conn.Close()
	err = call(cniapi.NewCNIEventsClient(conn))
	if err != nil && refused.Load() && status.Code(err) == codes.Unavailable {
		return noAgent{err}
	}
	return err
}

// noAgent is a call error that is also errNoAgent; its gRPC status is the
// wrapped error's.
type noAgent struct{ err error }

func (e noAgent) Error() string              { return e.err.Error() }
func (e noAgent) Unwrap() []error            { return []error{e.err, errNoAgent} }
func (e noAgent) GRPCStatus() *status.Status { return status.Convert(e.err) }

// statusOf returns the gRPC code and message of a call error.
func statusOf(err error) (codes.Code, string) {
	if st, ok := status.FromError(err); ok {
		return st.Code(), st.Message()
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return codes.DeadlineExceeded, err.Error()
	}
	return codes.Unknown, fmt.Sprint(err)
}
