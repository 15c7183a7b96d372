namespace torch { namespace autograd { struct Engine { void execute(int); }; 
void Engine::execute(int n) { asm volatile("" :: "r"(n)); } } }
extern "C" int main_like(int a) { return a + 1; }
int main() { return 0; }
