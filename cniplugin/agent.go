package cniplugin

import (
	"context"
	"errors"
	"fmt"
	"os"

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

// callAgent makes one call on a fresh connection to the agent's socket. The
// call fails fast (no wait-for-ready) when nothing listens there: the runtime
// retries the sandbox, which is better than holding it for the whole timeout.
func callAgent(ctx context.Context, socket string, call func(cniapi.CNIEventsClient) error) error {
	// Say plainly that the agent is not there instead of gRPC's dial error.
	if fi, err := os.Stat(socket); err != nil {
		return status.Errorf(codes.Unavailable, "agent socket: %v (is the ambientd agent running on this node?)", err)
	} else if fi.Mode()&os.ModeSocket == 0 {
		return status.Errorf(codes.Unavailable, "agent socket %s is not a socket", socket)
	}
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return types.NewError(types.ErrInvalidNetworkConfig, "ambientd-cni: invalid agentSocket", err.Error())
	}
	defer conn.Close()
	return call(cniapi.NewCNIEventsClient(conn))
}

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
